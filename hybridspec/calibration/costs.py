"""Cost model of a round and the pooled throughput `rho`, all times in milliseconds.

A round that verifies w input tokens takes `T(w) = fixed_ms + C_tgt(w)`: `fixed_ms` is the
w-independent part (drafting, launch overheads), `C_tgt(w)` the target's length-dependent cost,
fitted as a quadratic in w (`fit_round_cost`).

Routing correction (DESIGN.md section 2, step 4). Stage 0 has already run `w0 + 1` tokens through
Layer 0 (cost slope `s` ms per token, `fit_line`), so keeping the extra token costs
`C_tgt(w0+1) - C_tgt(w0) - s` plus its expert cost. `C_tgt(w0+1) - C_tgt(w0)` already contains the
*average* expert cost of one more token, because the curve was measured on real routing. The
routing tables therefore give only the deviation from that average, once Stage 0 shows how many
new Layer-0 experts the token brings (`n`):

    nbar[w0]          = E[distinct (layer, expert) pairs over all MoE layers among tokens 1..w0+1]
    nbar_given[w0][n] = the same expectation given that token w0 + 1 adds n new Layer-0 experts
    dL = C_tgt(w0+1) - C_tgt(w0) - s + eta * (nbar_given[w0][n] - nbar[w0])

with `eta` ms per distinct expert per MoE layer. Adding `eta * nbar_given[w0][n]` alone would
count the average expert cost twice. The extra token is kept when `p_{w0} > rho * dL`.

`rho` (tokens per ms) is the best pooled throughput `sum tokens / sum time` over per-round length
choices, found by Dinkelbach's iteration (`dinkelbach_rho`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hybridspec.calibration.acceptance import SKLEARN_HINT


@dataclass(frozen=True)
class RoundCost:
    """`T(w) = a0 + a1 w + a2 w^2` ms; `fixed_ms = a0`; `cost[w - 1] = C_tgt(w) = T(w) - a0`, w = 1..W.
    `rms_residual_ms`: root-mean-square misfit at the measured lengths."""

    coefficients: tuple[float, float, float]
    fixed_ms: float
    cost: tuple[float, ...]
    rms_residual_ms: float


def fit_round_cost(lengths, mean_round_ms, max_len: int | None = None) -> RoundCost:
    """Least-squares quadratic through the measured mean round times, with `a1, a2 >= 0`.

    `lengths` `[M]` verified lengths w, `mean_round_ms` `[M]` their mean round time (ms); at least
    three distinct lengths. `max_len` = W, the longest length of the cost curve (default: the
    longest measured). Verifying more tokens never costs less, but where rounds are launch-bound
    (small models, any GPU) the times are flat within noise and an unconstrained quadratic can
    turn down or go negative; the constraint keeps `C_tgt` non-negative and non-decreasing."""
    try:
        from sklearn.linear_model import LinearRegression
    except ImportError as e:
        raise ImportError(SKLEARN_HINT) from e

    w = np.asarray(lengths, dtype=np.float64).reshape(-1)
    t = np.asarray(mean_round_ms, dtype=np.float64).reshape(-1)
    if w.shape != t.shape:
        raise ValueError(f"fit_round_cost: lengths {w.shape} and mean_round_ms {t.shape} differ in shape")
    if len(np.unique(w)) < 3:
        raise ValueError(
            f"fit_round_cost: a quadratic needs at least 3 distinct lengths, got {sorted(set(w.tolist()))}"
        )
    if not np.all(np.isfinite(t)):
        raise ValueError("fit_round_cost: mean_round_ms has non-finite entries")
    W = int(max_len) if max_len is not None else int(w.max())
    if W < 1:
        raise ValueError(f"fit_round_cost: max_len must be at least 1, got {W}")
    V = np.stack([w, w * w], axis=1)
    fit = LinearRegression(positive=True).fit(V, t)
    a = (float(fit.intercept_), float(fit.coef_[0]), float(fit.coef_[1]))
    rms = float(np.sqrt(np.mean((fit.predict(V) - t) ** 2)))
    ws = np.arange(1, W + 1, dtype=np.float64)
    cost = a[1] * ws + a[2] * ws * ws
    return RoundCost(coefficients=a, fixed_ms=a[0], cost=tuple(float(c) for c in cost), rms_residual_ms=rms)


# a cost fit whose RMS residual exceeds this fraction of the mean measured round time is noise, not a curve
NOISY_COST_RESIDUAL = 0.10


def cost_fit_noise(rms_residual_ms: float, mean_round_ms) -> dict:
    """How far the measured round times stray from the fitted cost curve, for the artifact summary:
    `cost_rms_residual_ms`, `cost_relative_residual` (the residual over the mean measured round
    time), `noisy` (relative residual above `NOISY_COST_RESIDUAL`) and `noisy_reason` (None or why).
    On a loaded machine the timed lengths can come out in any order (w = 2 slower than w = 4); the
    quadratic, constrained non-decreasing, then misses them by about the round time itself."""
    t = np.asarray(mean_round_ms, dtype=np.float64).reshape(-1)
    if len(t) == 0 or not np.all(np.isfinite(t)) or t.mean() <= 0:
        raise ValueError(f"cost_fit_noise: mean_round_ms must be finite with a positive mean, got {t.tolist()}")
    relative = float(rms_residual_ms) / float(t.mean())
    noisy = relative > NOISY_COST_RESIDUAL
    reason = (f"RMS residual {rms_residual_ms:.3g} ms is {relative:.0%} of the mean round time {t.mean():.3g} ms "
              f"(> {NOISY_COST_RESIDUAL:.0%}); measured {t.min():.3g} to {t.max():.3g} ms") if noisy else None
    return dict(cost_rms_residual_ms=float(rms_residual_ms), cost_relative_residual=relative, noisy=bool(noisy),
                noisy_reason=reason)


def fit_line(x, y) -> tuple[float, float, float]:
    """Least-squares line `y = slope * x + intercept` and the Pearson correlation r.

    Used for `s` (Stage-0 ms per token) and `eta` (ms per distinct expert per MoE layer). `x`
    needs two distinct values. A constant `y` has no correlation to report: r = 0 (not NaN, so
    the artifact stays strict JSON), with slope 0."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if x.shape != y.shape:
        raise ValueError(f"fit_line: x {x.shape} and y {y.shape} differ in shape")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("fit_line: x and y must be finite")
    dx, dy = x - x.mean(), y - y.mean()
    sxx, syy = float(dx @ dx), float(dy @ dy)
    if sxx == 0:
        raise ValueError(f"fit_line: x needs at least two distinct values, got {sorted(set(x.tolist()))}")
    slope = float(dx @ dy) / sxx
    r = float(dx @ dy) / np.sqrt(sxx * syy) if syy > 0 else 0.0
    return slope, float(y.mean() - slope * x.mean()), float(np.clip(r, -1.0, 1.0))


class RoutingTables(NamedTuple):
    """`nbar[w0]`, w0 = 0..W-1: mean distinct (layer, expert) pairs over all MoE layers among the
    first w0 + 1 tokens. `nbar_given[w0][n]`, n = 0..k: the same mean over rounds whose token
    w0 + 1 adds n new Layer-0 experts (row 0 repeats `nbar[0]`: token 1 has nothing to add to)."""

    nbar: tuple[float, ...]
    nbar_given: tuple[tuple[float, ...], ...]


def routing_cell_counts(new_layer0, top_k: int) -> tuple[tuple[int, ...], ...]:
    """`new_layer0` `[R, W]` -> `counts[w0][n]`: rounds whose token w0 + 1 adds n new Layer-0
    experts (`[W][top_k + 1]`, row 0 all zero). A cell below `min_count` is filled in by `routing_tables`."""
    nl = np.asarray(new_layer0)
    counts = np.zeros((nl.shape[1], top_k + 1), dtype=np.int64)
    for w0 in range(1, nl.shape[1]):
        counts[w0] = (nl[:, w0, None] == np.arange(top_k + 1)).sum(0)
    return tuple(tuple(int(v) for v in row) for row in counts)


def routing_tables(distinct_all, new_layer0, top_k: int, min_count: int = 30) -> RoutingTables:
    """Expected expert unions from per-round routing captures.

    `distinct_all` `[R, W]`: column j-1 = distinct (layer, expert) pairs over all MoE layers among
    the first j input tokens. `new_layer0` `[R, W]` ints in 0..`top_k`: column j-1 = Layer-0
    experts token j adds to the union of tokens 1..j-1.

    A cell with fewer than `min_count` rounds is replaced by a line in n fitted, weighted by the
    cell counts, over the row's cells that have enough; in a row with fewer than two such cells
    the short cells take `nbar[w0]` (no deviation from the average)."""
    d = np.asarray(distinct_all, dtype=np.float64)
    nl = np.asarray(new_layer0)
    if d.ndim != 2 or nl.shape != d.shape or d.shape[0] == 0:
        raise ValueError(f"routing_tables: distinct_all {d.shape} and new_layer0 {nl.shape} must both be [R, W], R > 0")
    if nl.min() < 0 or nl.max() > top_k:
        raise ValueError(f"routing_tables: new_layer0 must lie in 0..{top_k}")
    W = d.shape[1]
    n_values = np.arange(top_k + 1)
    nbar = d.mean(0)
    given = np.tile(nbar[:, None], (1, top_k + 1))
    counts = np.array(routing_cell_counts(nl, top_k))
    for w0 in range(1, W):
        onehot = nl[:, w0, None] == n_values  # [R, k + 1]
        sums = d[:, w0] @ onehot
        enough = counts[w0] >= min_count
        means = np.divide(sums, counts[w0], out=np.zeros(top_k + 1), where=counts[w0] > 0)
        given[w0, enough] = means[enough]
        if enough.all():
            continue
        if enough.sum() >= 2:
            slope, intercept = np.polyfit(n_values[enough], means[enough], 1, w=np.sqrt(counts[w0, enough]))
            given[w0, ~enough] = slope * n_values[~enough] + intercept
        else:
            given[w0, ~enough] = nbar[w0]
    return RoutingTables(
        nbar=tuple(float(v) for v in nbar),
        nbar_given=tuple(tuple(float(v) for v in row) for row in given),
    )


def _round_times(cost, fixed_ms: float, W: int) -> np.ndarray:
    """`[W]` round times `fixed_ms + cost[w - 1]` for w = 1..W, validated for w = 2..W."""
    cost = np.asarray(cost, dtype=np.float64).reshape(-1)
    if W < 2:
        raise ValueError("the selector needs lengths 2..W with W >= 2")
    if len(cost) < W:
        raise ValueError(f"cost has {len(cost)} entries, the gains need {W} (w = 1..{W})")
    time = fixed_ms + cost[:W]
    if np.any(time[1:] <= 0):
        raise ValueError(f"round times fixed_ms + cost[w] must be positive for w = 2..{W}, got {time[1:].tolist()}")
    return time


def dinkelbach_rho(gains, cost, fixed_ms: float, tol: float = 1e-9, max_iter: int = 100) -> float:
    """Best pooled throughput `max over w_r of sum_r gains[r, w_r - 1] / sum_r (fixed_ms + C_tgt(w_r))`.

    `gains` `[R, W]`: column w-1 = expected tokens of round r verified at length w (columns for
    w < 2 are ignored: the selector picks 2..W). `cost` `[>= W]` ms, `cost[w - 1] = C_tgt(w)`.
    Returns tokens/ms. Each step assigns `w_r = argmax_{2 <= w <= W} gains[r, w-1] - rho * C_tgt(w)`
    (ties to the shorter w) and sets rho to that assignment's ratio; it stops when rho moves by at
    most `tol * max(1, rho)` or the assignment repeats."""
    g = np.asarray(gains, dtype=np.float64)
    if g.ndim != 2 or g.shape[0] == 0:
        raise ValueError(f"dinkelbach_rho: gains {g.shape} must be [R, W] with R > 0")
    time = _round_times(cost, fixed_ms, g.shape[1])[1:]
    g = g[:, 1:]
    rows = np.arange(len(g))
    rho, choice = 0.0, None
    for _ in range(max_iter):
        # time differs from cost by the constant fixed_ms: the same argmax
        new_choice = np.argmax(g - rho * time, axis=1)
        new_rho = g[rows, new_choice].sum() / time[new_choice].sum()
        converged = abs(new_rho - rho) <= tol * max(1.0, abs(new_rho))
        repeated = choice is not None and np.array_equal(new_choice, choice)
        rho, choice = float(new_rho), new_choice
        if converged or repeated:
            return rho
    raise RuntimeError(f"dinkelbach_rho: no fixed point after {max_iter} iterations (rho = {rho})")


def best_static_length(tokens, cost, fixed_ms: float) -> int:
    """`tokens` `[R, W]`: column w-1 = tokens round r emits at length w (`min(A, w - 1) + 1`);
    `cost[w - 1] = C_tgt(w)` ms. Returns the w in 2..W with the highest
    `sum_r tokens[r, w - 1] / sum_r (fixed_ms + C_tgt(w))`, ties to the shorter."""
    t = np.asarray(tokens, dtype=np.float64)
    if t.ndim != 2 or t.shape[0] == 0:
        raise ValueError(f"best_static_length: tokens {t.shape} must be [R, W] with R > 0")
    time = _round_times(cost, fixed_ms, t.shape[1])
    throughput = t.sum(0)[1:] / (len(t) * time[1:])
    return int(np.argmax(throughput)) + 2
