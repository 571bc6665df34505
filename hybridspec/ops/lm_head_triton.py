"""Top-1 token, its probability and the softmax entropy of `hidden @ weight.T`, in one pass over
the weight, without the `[N, V]` logits.

1. `lm_head_partial_kernel`, grid (V / BV, row blocks): each program multiplies its BM rows by a
   BV-row tile of the weight (fp32 accumulation), rounds the logits to the weight's dtype and,
   with a scale, rounds `logit * scale` again (what `F.linear(...) * scale` computes), and stores per
   row the tile's maximum, the first index reaching it, `S = sum exp(l - max)` and
   `T = sum exp(l - max) (l - max)`, row-major `[N, tiles]`.
2. `lm_head_combine_kernel`, grid (N,): merges the tiles in index order, reading its row's
   partials contiguously (tile-major partials put consecutive tiles N values apart; row-major took
   3-4 us off a call at 15-60 rows on the H200, docs/benchmarks.md). With `M` the overall
   maximum, `S = sum_t S_t e^(m_t - M)` and `T = sum_t e^(m_t - M) (T_t + (m_t - M) S_t)`; the
   top-1 probability is `1 / S` (its logit is M) and the entropy `log S - T / S` (nats).

Ties: within a tile `tl.argmax` keeps the first index of the maximum, and the combine replaces the
running argmax only on a strictly larger tile maximum, so the result is the first index of the
maximum over the whole vocabulary, as `torch.argmax` picks it. The logits are the rounded values
the eager path computes, so a maximum shared after rounding is broken the same way.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.moe_triton import _round_bf16
from hybridspec.ops.pdl_triton import pdl_enter


@triton.jit
def _round_to(x, ROUND: tl.constexpr):
    """fp32 `x` rounded to the weight dtype, still fp32. ROUND: 0 fp32 (none), 1 bf16, 2 fp16,
    3 bf16 under the interpreter (whose fp32 -> bf16 cast truncates)."""
    if ROUND == 1:
        x = x.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    elif ROUND == 3:
        x = _round_bf16(x)
    return x


@triton.jit
def lm_head_partial_kernel(
    x_ptr, w_ptr, max_ptr, idx_ptr, sum_ptr, dot_ptr,
    N, V, scale,
    s_xn, s_wv,
    H: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    HAS_SCALE: tl.constexpr, ROUND: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    i_v = tl.program_id(0)
    i_m = tl.program_id(1)
    rows = i_m * BM + tl.arange(0, BM)
    cols = i_v * BV + tl.arange(0, BV)
    row_ok = rows < N
    col_ok = cols < V
    acc = tl.zeros([BM, BV], dtype=tl.float32)
    w_base = w_ptr + cols[:, None].to(tl.int64) * s_wv
    for k0 in range(0, H, BK):
        ck = k0 + tl.arange(0, BK)
        k_ok = ck < H
        x = tl.load(x_ptr + rows[:, None] * s_xn + ck[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + ck[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BV, BK]
        # the interpreter multiplies 16-bit dot operands wrongly: upcast there (exact products)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    logit = _round_to(acc, ROUND)
    if HAS_SCALE:
        logit = _round_to(logit * scale, ROUND)
    logit = tl.where(col_ok[None, :], logit, float("-inf"))
    m = tl.max(logit, axis=1)  # [BM]
    arg = tl.argmax(logit, axis=1, tie_break_left=True)
    e = tl.exp(logit - m[:, None])
    s = tl.sum(e, axis=1)
    # columns past V: e = 0 but l - m = -inf, so select before multiplying
    t = tl.sum(e * tl.where(col_ok[None, :], logit - m[:, None], 0.0), axis=1)
    # row-major partials [N, tiles]: the combine program of a row reads its tiles contiguously
    at = rows * tl.num_programs(0) + i_v
    tl.store(max_ptr + at, m, mask=row_ok)
    tl.store(idx_ptr + at, i_v * BV + arg, mask=row_ok)
    tl.store(sum_ptr + at, s, mask=row_ok)
    tl.store(dot_ptr + at, t, mask=row_ok)


@triton.jit
def lm_head_combine_kernel(
    max_ptr, idx_ptr, sum_ptr, dot_ptr, tok_ptr, conf_ptr, ent_ptr,
    N, NT,
    BT: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    n = tl.program_id(0)
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    best = tl.zeros([1], dtype=tl.int32)
    total = tl.zeros([1], dtype=tl.float32)
    dot = tl.zeros([1], dtype=tl.float32)
    lanes = tl.arange(0, BT)
    for t0 in range(0, NT, BT):
        t = t0 + lanes
        ok = t < NT
        m_t = tl.load(max_ptr + n * NT + t, mask=ok, other=float("-inf"))
        s_t = tl.load(sum_ptr + n * NT + t, mask=ok, other=0.0)
        d_t = tl.load(dot_ptr + n * NT + t, mask=ok, other=0.0)
        i_t = tl.load(idx_ptr + n * NT + t, mask=ok, other=0)
        cm = tl.max(m_t, axis=0)
        # the first tile of this chunk that reaches its maximum holds the first such index
        first = tl.argmax(m_t, axis=0, tie_break_left=True)
        ci = tl.sum(tl.where(lanes == first, i_t, 0), axis=0)
        best = tl.where(cm > m, ci, best)
        m_new = tl.maximum(m, cm)
        # m is -inf before the first chunk (total 0), as is m_t past NT (s_t 0): select the
        # shift before multiplying, never -inf * 0
        alpha = tl.exp(m - m_new)
        old = alpha * (dot + tl.where(total > 0, m - m_new, 0.0) * total)
        f = tl.exp(m_t - m_new)
        new = tl.sum(f * (d_t + tl.where(ok, m_t - m_new, 0.0) * s_t), axis=0)
        dot = old + new
        total = alpha * total + tl.sum(f * s_t, axis=0)
        m = m_new
    one = tl.arange(0, 1)
    tl.store(tok_ptr + n + one, best.to(tl.int64))
    tl.store(conf_ptr + n + one, 1.0 / total)
    tl.store(ent_ptr + n + one, tl.log(total) - dot / total)
