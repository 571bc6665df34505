"""Synthetic drafting rounds with known acceptance probabilities."""

from __future__ import annotations

import numpy as np


def logit(p):
    return np.log(p) - np.log1p(-p)


def sigmoid(z):
    return 1 / (1 + np.exp(-z))


def true_acceptance(conf: np.ndarray, slope: float = 2.0) -> np.ndarray:
    """c_i = sigmoid(slope * logit(conf_i) + b_i), b_i falling with the position: the raw
    confidence is overconfident, more so deep in the block."""
    D = conf.shape[1]
    b = -1.0 - 0.1 * np.arange(1, D + 1)
    return sigmoid(slope * logit(np.clip(conf, 1e-6, 1 - 1e-6)) + b)


def synthetic_rounds(R: int, D: int, seed: int, slope: float = 2.0):
    """(conf, entropy, accepted, c) for R rounds of D drafts; c `[R, D]` the true probabilities.

    Entropy (nats) tracks `-log(conf)` with noise; it carries no information beyond confidence."""
    rng = np.random.default_rng(seed)
    conf = rng.beta(5.0, 1.2, size=(R, D))
    entropy = -np.log(conf) * rng.uniform(0.5, 2.0, size=(R, D)) + rng.exponential(0.05, size=(R, D))
    c = true_acceptance(conf, slope)
    ok = rng.random((R, D)) < c
    accepted = np.where(ok.all(1), D, np.argmin(ok, axis=1))
    return conf, entropy, accepted, c
