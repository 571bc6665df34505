"""Synthetic drafting rounds with known acceptance probabilities, and a synthetic calibration."""

from __future__ import annotations

import numpy as np

from hybridspec.calibration import AcceptanceModel, Calibration, current_device_name, runtime_versions
from hybridspec.fingerprint import drafter_fingerprint, target_fingerprint


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


W, TOP_K = 16, 2


def synthetic_calibration(model, drafter, **overrides) -> Calibration:
    """A calibration whose correction often adds a token, and does so depending on n_new: c_i is
    the raw confidence, C(w) = 0.1 w ms, rho = 2 (w0 extends while p_i > 0.2); Stage 0 saves
    0.08 ms per token and each new Layer-0 expert beyond the first costs 0.01 ms."""
    identity = ((0.0, 1.0),) * (W - 1)
    fields = dict(
        target_fingerprint=target_fingerprint(model), drafter_fingerprint=drafter_fingerprint(drafter),
        device_name=current_device_name(model.device), versions=runtime_versions(), block_size=W,
        acceptance=AcceptanceModel(iso_x=identity, iso_y=identity, n_labels=(100,) * (W - 1), coef=None,
                                   intercept=None, mean=None, scale=None),
        cost=tuple(0.1 * w for w in range(1, W + 1)), fixed_ms=1.0, stage0_slope_ms=0.08, eta_ms=0.01,
        top_k=TOP_K, nbar=tuple(float(3 * w) for w in range(W)),
        nbar_given=tuple(tuple(3.0 * w + n - 1 for n in range(TOP_K + 1)) for w in range(W)),
        rho=2.0, static_length=6,
    )
    fields.update(overrides)
    return Calibration(**fields)
