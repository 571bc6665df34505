"""Cost fits, routing tables, Dinkelbach's rho, the best static length and the routing correction."""

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hybridspec.policy import keep_extra_token
from hybridspec.calibration import (
    best_static_length,
    dinkelbach_rho,
    fit_line,
    fit_round_cost,
    routing_cell_counts,
    routing_tables,
)
from hybridspec.policy import LengthPolicy, prefix_probabilities


def test_fit_round_cost_recovers_a_quadratic():
    lengths = np.array([2, 4, 8, 12, 16, 16])
    fit = fit_round_cost(lengths, 3.0 + 0.2 * lengths + 0.01 * lengths**2)
    assert fit.coefficients == pytest.approx((3.0, 0.2, 0.01))
    assert fit.fixed_ms == pytest.approx(3.0)
    assert fit.cost == pytest.approx([0.2 * w + 0.01 * w * w for w in range(1, 17)])
    assert fit.rms_residual_ms < 1e-9
    assert len(fit_round_cost([2, 3, 4], [1.0, 2.0, 3.0], max_len=16).cost) == 16


def test_fit_round_cost_never_decreases():
    # launch-bound rounds: flat times with noise that an unconstrained quadratic bends downwards
    fit = fit_round_cost([2, 8, 16], [43.0, 41.3, 42.0])
    assert all(c >= 0 for c in fit.cost) and list(fit.cost) == sorted(fit.cost)
    assert fit.fixed_ms == pytest.approx(42.1, abs=1.0)


def test_fit_round_cost_needs_three_distinct_lengths():
    with pytest.raises(ValueError, match="3 distinct lengths"):
        fit_round_cost([4, 4, 8], [1.0, 1.1, 2.0])


def test_fit_line():
    slope, intercept, r = fit_line([1, 2, 3, 4], [3.5, 5.0, 6.5, 8.0])
    assert (slope, intercept, r) == pytest.approx((1.5, 2.0, 1.0))
    assert fit_line([1, 2, 3], [3, 2, 1])[2] == pytest.approx(-1.0)
    # a constant response: no correlation to report, r = 0 rather than NaN
    assert fit_line([1, 2, 3], [2.0, 2.0, 2.0]) == (0.0, 2.0, 0.0)
    with pytest.raises(ValueError, match="two distinct values"):
        fit_line([1, 1, 1], [1, 2, 3])


def test_routing_tables_are_the_cell_means_when_cells_are_large():
    rng = np.random.default_rng(0)
    R, W, k = 600, 5, 3
    new = rng.integers(0, k + 1, size=(R, W))
    distinct = rng.integers(1, 40, size=(R, W)).astype(float)
    nbar, nbar_given = routing_tables(distinct, new, top_k=k, min_count=1)
    counts = routing_cell_counts(new, top_k=k)
    assert nbar == pytest.approx(distinct.mean(0))
    assert nbar_given[0] == pytest.approx([distinct[:, 0].mean()] * (k + 1))
    for w0, n in itertools.product(range(1, W), range(k + 1)):
        cell = new[:, w0] == n
        assert counts[w0][n] == cell.sum() > 0
        assert nbar_given[w0][n] == pytest.approx(distinct[cell, w0].mean())


def test_routing_tables_fill_small_cells_by_a_line_in_n():
    k = 4
    # row w0 = 1: cells n = 0, 1, 2 have 50, 50, 40 rounds with mean 10 + 3n; n = 3 has 5 rounds
    # (a different mean), n = 4 none. Row w0 = 2: only n = 1 has enough rounds.
    counts = {0: 50, 1: 50, 2: 40, 3: 5}
    n1 = np.concatenate([np.full(c, n) for n, c in counts.items()])
    R = len(n1)
    # +-1 around the cell mean, alternating: the cell means are exact
    noise = np.where(np.arange(R) % 2 == 0, 1.0, -1.0)
    d1 = np.where(n1 == 3, 50.0, 10.0 + 3.0 * n1 + noise)
    n2 = np.where(np.arange(R) < 100, 1, np.arange(R) % 5)
    d2 = 20.0 + n2 + noise
    distinct = np.stack([np.full(R, 4.0), d1, d2], axis=1)
    new = np.stack([np.full(R, k), n1, n2], axis=1)
    t = routing_tables(distinct, new, top_k=k, min_count=30)
    assert t.nbar_given[1] == pytest.approx([10.0, 13.0, 16.0, 19.0, 22.0])
    assert routing_cell_counts(new, top_k=k)[1] == (50, 50, 40, 5, 0)
    # fewer than two sufficient cells: no deviation from the average
    m1 = d2[n2 == 1].mean()
    assert t.nbar_given[2] == pytest.approx([t.nbar[2], m1, t.nbar[2], t.nbar[2], t.nbar[2]])


def brute_rho(gains, cost, fixed):
    R, W = gains.shape
    best = 0.0
    for ws in itertools.product(range(2, W + 1), repeat=R):
        g = sum(gains[r, w - 1] for r, w in enumerate(ws))
        best = max(best, g / sum(fixed + cost[w - 1] for w in ws))
    return best


@settings(max_examples=150)
@given(data=st.data(), R=st.integers(1, 4), W=st.integers(2, 5), fixed=st.floats(0, 5))
def test_dinkelbach_rho_is_the_brute_force_optimum(data, R, W, fixed):
    floats = st.floats(0, 16, allow_subnormal=False)
    gains = np.array(data.draw(st.lists(st.lists(floats, min_size=W, max_size=W), min_size=R, max_size=R)))
    cost = data.draw(st.lists(st.floats(0.1, 10), min_size=W, max_size=W))
    rho = dinkelbach_rho(gains, cost, fixed)
    assert rho == pytest.approx(brute_rho(gains, cost, fixed), rel=1e-9, abs=1e-12)


def test_dinkelbach_rho_is_attained_by_the_selector():
    # gains of a real selector: 1 + p_1 + ... + p_{w-1}; at the fixed point the selector's own
    # per-round lengths realise rho
    torch.manual_seed(0)
    c = torch.rand(64, 15) ** 0.3
    p = prefix_probabilities(c).double()
    gains = torch.cat([torch.ones(64, 1, dtype=torch.float64), 1 + torch.cumsum(p, -1)], dim=1).numpy()
    cost = tuple(0.9 * w + 0.02 * w * w for w in range(1, 17))
    fixed = 4.0
    rho = dinkelbach_rho(gains, cost, fixed)
    w = LengthPolicy(cost=cost, rho=rho).select(c, 16).numpy()
    ratio = gains[np.arange(64), w - 1].sum() / sum(fixed + cost[x - 1] for x in w)
    assert ratio == pytest.approx(rho, rel=1e-5)


def test_dinkelbach_rejects_non_positive_times():
    with pytest.raises(ValueError, match="positive"):
        dinkelbach_rho(np.ones((2, 3)), [1.0, -2.0, 1.0], fixed_ms=1.0)


@settings(max_examples=150)
@given(data=st.data(), R=st.integers(1, 6), W=st.integers(2, 8))
def test_best_static_length_is_the_brute_force_argmax(data, R, W):
    A = np.array(data.draw(st.lists(st.integers(0, W - 1), min_size=R, max_size=R)))
    tokens = np.minimum(A[:, None], np.arange(W)) + 1  # [R, W]: min(A, w - 1) + 1
    cost = data.draw(st.lists(st.integers(1, 20), min_size=W, max_size=W))
    fixed = data.draw(st.integers(0, 10))
    # exact rationals: ties are ties
    score = {w: Fraction(int(tokens[:, w - 1].sum()), R * (fixed + cost[w - 1])) for w in range(2, W + 1)}
    want = max(score, key=lambda w: (score[w], -w))
    assert best_static_length(tokens, cost, fixed) == want


def reference_keep(p, rho, cost, w0, s, eta, nbar, nbar_given, n):
    W = len(cost)
    if w0 >= W:
        return False
    dL = cost[w0] - cost[w0 - 1] - s + eta * (nbar_given[w0][n] - nbar[w0])
    return p > rho * dL


def test_keep_extra_token_matches_the_scalar_rule():
    rng = np.random.default_rng(0)
    B, W, k = 200, 16, 8
    cost = np.cumsum(rng.uniform(0.01, 0.3, W))
    nbar = np.cumsum(rng.uniform(1, 20, W))
    nbar_given = nbar[:, None] + rng.normal(0, 5, (W, k + 1))
    p = rng.uniform(0, 1, B)
    w0 = rng.integers(2, W + 1, B)
    n = rng.integers(0, k + 1, B)
    rho, s, eta = 1.5, 0.1, 0.01
    got = keep_extra_token(
        torch.tensor(p), rho, torch.tensor(cost), torch.tensor(w0), s, eta,
        torch.tensor(nbar), torch.tensor(nbar_given), torch.tensor(n),
    )
    want = [reference_keep(p[b], rho, cost, w0[b], s, eta, nbar, nbar_given, n[b]) for b in range(B)]
    assert got.dtype == torch.bool and got.tolist() == want
    assert 0 < sum(want) < B
    assert not got[torch.tensor(w0) == W].any()
    # on meta tensors: gathers only, nothing is read back to the host
    index = torch.empty(B, dtype=torch.long, device="meta")
    meta = keep_extra_token(
        torch.empty(B, device="meta"), rho, torch.empty(W, device="meta"), index, s, eta,
        torch.empty(W, device="meta"), torch.empty(W, k + 1, device="meta"), index,
    )
    assert meta.shape == (B,) and meta.dtype == torch.bool


@settings(max_examples=120)
@given(data=st.data(), D=st.integers(2, 15), k=st.integers(1, 8), rho=st.floats(0.1, 5),
       eta=st.floats(0, 0.5), B=st.integers(1, 6))
def test_no_expansion_when_stage0_saving_is_below_the_routing_deviation(data, D, k, rho, eta, B):
    W = D + 1
    unit = st.floats(0, 1)
    conf = torch.tensor(data.draw(st.lists(st.lists(unit, min_size=D, max_size=D), min_size=B, max_size=B)))
    steps = data.draw(st.lists(st.floats(-0.2, 0.6), min_size=W, max_size=W))
    cost = torch.tensor(np.cumsum(steps), dtype=torch.float32)
    nbar = torch.tensor(data.draw(st.lists(st.floats(0, 50), min_size=W, max_size=W)))
    nbar_given = torch.tensor(data.draw(st.lists(st.lists(st.floats(0, 50), min_size=k + 1, max_size=k + 1),
                                                 min_size=W, max_size=W)))
    n = torch.tensor(data.draw(st.lists(st.integers(0, k), min_size=B, max_size=B)))
    slack = data.draw(st.floats(0, 2))

    w0 = LengthPolicy(cost=tuple(cost.tolist()), rho=rho).select(conf, W)
    p = prefix_probabilities(conf)
    p_w0 = p.gather(1, (w0 - 1).clamp(max=D - 1)[:, None])[:, 0]
    keep = []
    for b in range(B):
        i = int(w0[b])
        # s at or below the routing deviation of this round's extra token
        s = eta * float(nbar_given[min(i, W - 1), n[b]] - nbar[min(i, W - 1)]) - slack
        keep.append(bool(keep_extra_token(p_w0[b:b + 1], rho, cost, w0[b:b + 1], s, eta, nbar, nbar_given, n[b:b + 1])))
        if i >= W:
            assert not keep[-1]
            continue
        # the selector compares fp32 scores: leave out rounds within rounding of a tie
        margin = rho * float(cost[i] - cost[i - 1]) - float(p_w0[b])
        if abs(margin) > 1e-4:
            event("round checked: w0 < W and not a near-tie")
            assert not keep[-1], (i, margin)
