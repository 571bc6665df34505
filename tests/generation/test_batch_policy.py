"""The batched length policy (issue 18) against a brute-force numpy evaluation of its rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridspec import policy as policy_module
from hybridspec.cache import BoundedCache
from hybridspec.drafter.protocol import DraftBlock
from hybridspec.policy import BatchPolicy, BatchRoutingCorrection, FixedPolicy, Selection, default_policy

LENGTHS = (2, 4, 8, 12, 16)


def brute_choice(conf: np.ndarray, cap: np.ndarray, lengths, cost, rho) -> int:
    """argmax over the set of sum_b G_b(min(w, cap_b)) - rho C(w), a length past every budget
    counting as the largest budget; ties to the shorter."""
    p = np.cumprod(np.clip(conf, 0, 1), axis=1)
    best, choice = -np.inf, None
    for w, c in zip(lengths, cost):
        if w > conf.shape[1] + 1:
            continue
        eff = min(w, cap.max())
        gain = sum(1 + p[b, : min(eff, cap[b]) - 1].sum() for b in range(len(cap)))
        score = gain - rho * c
        if score > best + 1e-9:
            best, choice = score, eff
    return choice


@settings(max_examples=60, deadline=None)
@given(B=st.sampled_from([2, 4]), seed=st.integers(0, 2**16), rho=st.floats(0.1, 8.0),
       caps=st.lists(st.integers(1, 20), min_size=4, max_size=4))
def test_batch_choice_matches_brute_force(B, seed, rho, caps):
    rng = np.random.default_rng(seed)
    conf = rng.beta(5, 2, size=(B, 15)).astype(np.float32)
    cost = tuple(sorted(rng.uniform(1.0, 4.0, size=5)))
    policy = BatchPolicy("hybridspec", B, LENGTHS, cost, rho)
    cap = np.array(caps[:B])
    block = DraftBlock(torch.zeros(B, 15, dtype=torch.long), torch.from_numpy(conf), torch.zeros(B, 15))
    w0 = policy.select(block, torch.from_numpy(cap)).w0
    assert w0.shape == (B,) and len(set(w0.tolist())) == 1
    assert int(w0[0]) == brute_choice(conf, cap, LENGTHS, cost, rho)


def test_fixed_length_is_shared_and_capped_by_the_largest_budget():
    block = DraftBlock(torch.zeros(3, 15, dtype=torch.long), torch.ones(3, 15), torch.zeros(3, 15))
    assert FixedPolicy("fixed", 8).select(block, torch.tensor([2, 5, 1])).w0.tolist() == [5, 5, 5]
    assert FixedPolicy("fixed", 8).select(block, torch.tensor([20, 5, 1])).w0.tolist() == [8, 8, 8]


def test_default_batched_policy_warns_and_is_one_object(monkeypatch):
    # the warning is once per process: another test in this worker may have had it already
    monkeypatch.setattr(policy_module, "_WARNED", BoundedCache(1))
    with pytest.warns(UserWarning, match="built-in default"):
        default_policy("hybridspec", 16, 1)
    a, b = default_policy("hybridspec", 16, 2), default_policy("hybridspec", 16, 2)
    assert a is b and isinstance(a, BatchPolicy) and a.lengths == LENGTHS


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), w0_index=st.integers(0, 4), eta=st.floats(0.0, 1.0), rho=st.floats(0.1, 4.0))
def test_batch_correction_matches_brute_force(seed, w0_index, eta, rho):
    rng = np.random.default_rng(seed)
    B, W, k, E = 2, 16, 2, 8
    ids = torch.from_numpy(rng.integers(0, E, size=(B, W, k)))
    conf = rng.beta(5, 2, size=(B, W - 1)).astype(np.float32)
    cost = tuple(sorted(rng.uniform(1.0, 3.0, size=5)))
    nbar = tuple(rng.uniform(0, 3, size=4).tolist()) + (0.0,)
    corr = BatchRoutingCorrection(LENGTHS, cost, rho, eta, nbar)
    prefix = torch.from_numpy(np.cumprod(conf, axis=1))
    w0 = LENGTHS[w0_index]
    cap = torch.tensor([20, 20])
    got = corr.extend(Selection(torch.full((B,), w0), prefix), ids, cap, E)
    # brute force
    if w0_index == 4:
        expected = w0
    else:
        w1 = LENGTHS[w0_index + 1]
        union = lambda n: len(set(ids[:, :n].flatten().tolist()))  # noqa: E731
        n_new = union(w1) - union(w0)
        p = np.cumprod(conf, axis=1)
        gain = sum(p[b, w0 - 1: w1 - 1].sum() for b in range(B))
        dL = cost[w0_index + 1] - cost[w0_index] + eta * (n_new - nbar[w0_index])
        expected = w1 if gain > rho * dL else w0
    assert got.tolist() == [expected] * B
