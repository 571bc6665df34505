"""The MoE router's post-GEMM work in one kernel: fp32 softmax over a row's E logits, the k largest
probabilities in descending order, optionally renormalised, cast to the logits' dtype.

`route_topk_kernel`, grid (R,): one program holds one row, E padded to the power of two EP (padding
lanes are -inf logits, probability 0, and never chosen before a real expert: they carry the largest
indices and k <= E). Softmax: `p = e^(l - max) / sum e^(l - max)` (IEEE division). Then k rounds of
one reduction each that gives the maximum remaining probability and the lowest lane reaching it
(`tie_break_left`), which is then masked out: the order of a stable descending sort, ties to the
lowest index. The chosen values are summed in fp32 in slot order, each divided by the sum (IEEE
division, as torch divides), then cast.

The work is `_route_rows`, over a block of rows at once; the fused router kernel
(`router_triton.py`) runs it on every row of its GEMM's output in one program, in another layout
(a block of rows, its own warp count). Its results must be this kernel's bits, so no value depends
on the order in which a reduction combines lanes, which the compiler picks per layout: the maximum
and the (value, lowest index) reduction are exact in any order; the softmax's sum is taken in
integers (below); the renormalising sum adds the k chosen values one slot after the other.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.moe_triton import _round_bf16

# the softmax's terms e^(l - max) lie in [0, 1] (the maximum's is 1, so the sum is >= 1): in units
# of 2**-40 each truncates by < 2**-40 and at most 1024 of them sum below 2**50 in an int64, exactly
# in any order; the sum, converted once, is the fp32 sum's correct rounding but for a truncation of
# < 2**-30 (fp32 keeps 2**-24 of the sum). Below 2**53 the conversion rounds once whether it goes
# through fp64 (numpy, the interpreter) or not (the GPU's cvt.rn).
SUM_SCALE: tl.constexpr = tl.constexpr(2.0**40)


@triton.jit
def _exact_sum(e):
    """The sum over axis 1 of `e` `[RB, EP]`, values in [0, 1], as the same fp32 whatever the order
    of the reduction (see `SUM_SCALE`)."""
    # a NaN term (a poisoned row) would make the integer cast undefined: it counts as 0 there, and
    # its own probability stays NaN
    fixed = (tl.where(e <= 1.0, e, 0.0) * SUM_SCALE).to(tl.int64)
    return tl.sum(fixed, axis=1).to(tl.float32) * (1.0 / SUM_SCALE)


@triton.jit
def _route_rows(
    logits_ptr, w_ptr, ids_ptr,
    rows, R, E, k, s_lr,
    RB: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr, NORMALIZE: tl.constexpr, INTERPRET_BF16: tl.constexpr,
    CACHE: tl.constexpr,
):
    """Weights and ids `[R, k]` (contiguous) of the rows `rows` `[RB]` (int64) that are < R, from
    `logits` rows of stride `s_lr`; `CACHE` is the loads' cache modifier."""
    row_ok = rows < R
    lanes = tl.arange(0, EP)
    lane_ok = lanes < E
    x = tl.load(logits_ptr + rows[:, None] * s_lr + lanes[None, :], mask=row_ok[:, None] & lane_ok[None, :],
                other=float("-inf"), cache_modifier=CACHE).to(tl.float32)  # [RB, EP]
    # rows past R: a finite softmax of zeros, computed and never stored
    x = tl.where(row_ok[:, None], x, 0.0)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = tl.math.div_rn(e, tl.zeros([RB, EP], dtype=tl.float32) + _exact_sum(e)[:, None])
    # padding lanes hold probability 0 like an underflowed expert; -inf keeps them last
    cand = tl.where(lane_ok[None, :], p, float("-inf"))
    slots = tl.arange(0, KP)
    vals = tl.zeros([RB, KP], dtype=tl.float32)
    ids = tl.zeros([RB, KP], dtype=tl.int32)
    total = tl.zeros([RB], dtype=tl.float32)
    for j in range(k):
        # one (value, index) reduction whose combine prefers the lower index on equal values; the
        # interpreter always breaks ties left (numpy's argmax), so only the CUDA tests prove this rule
        m, at = tl.max(cand, axis=1, return_indices=True, return_indices_tie_break_left=True)
        vals = tl.where(slots[None, :] == j, m[:, None], vals)
        ids = tl.where(slots[None, :] == j, at[:, None], ids)
        total = total + m
        cand = tl.where(lanes[None, :] == at[:, None], float("-inf"), cand)
    if NORMALIZE:
        vals = tl.math.div_rn(vals, tl.zeros([RB, KP], dtype=tl.float32) + total[:, None])
    # the interpreter's fp32 -> bf16 cast truncates
    if INTERPRET_BF16:
        vals = _round_bf16(vals)
    out = rows[:, None] * k + slots[None, :]
    written = row_ok[:, None] & (slots < k)[None, :]
    tl.store(w_ptr + out, vals.to(w_ptr.dtype.element_ty), mask=written)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=written)


@triton.jit
def route_topk_kernel(
    logits_ptr, w_ptr, ids_ptr,
    E, k, s_lr,
    EP: tl.constexpr, KP: tl.constexpr, NORMALIZE: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    _route_rows(logits_ptr, w_ptr, ids_ptr, rows, tl.num_programs(0), E, k, s_lr,
                1, EP, KP, NORMALIZE, INTERPRET_BF16, "")
