"""The MoE router's post-GEMM work in one kernel: fp32 softmax over a row's E logits, the k largest
probabilities in descending order, optionally renormalised, cast to the logits' dtype.
`route_topk_partials_kernel` first adds the router GEMM's split-K partial sums (s = 0, 1, ... in
order, fp32) and rounds them to the logits' dtype, as the GEMM's own output is rounded; the columns
past the E experts (the block's other fused rows: the shared expert's gate) it adds, rounds and
stores for their consumer.

`route_topk_kernel`, grid (R,): one program holds one row, E padded to the power of two EP (padding
lanes are -inf logits, probability 0, and never chosen before a real expert: they carry the largest
indices and k <= E). Softmax: `p = e^(l - max) / sum e^(l - max)` (IEEE division). Then k rounds of
one reduction each that gives the maximum remaining probability and the lowest lane reaching it
(`tie_break_left`), which is then masked out: the order of a stable descending sort, ties to the
lowest index. The chosen values are summed in fp32 (slots past k hold 0), each divided by the sum
(IEEE division, as torch divides), then cast.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.moe_triton import _round_bf16, _round_to
from hybridspec.ops.pdl_triton import pdl_enter


@triton.jit
def _select_store(x, ok, lanes, w_ptr, ids_ptr, r, k,
                  KP: tl.constexpr, NORMALIZE: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """Row r's softmax over its fp32 logits `x` `[EP]` (-inf on padding lanes), the top k, stored."""
    e = tl.exp(x - tl.max(x, axis=0))
    p = tl.math.div_rn(e, tl.sum(e, axis=0))
    # padding lanes hold probability 0 like an underflowed expert; -inf keeps them last
    cand = tl.where(ok, p, float("-inf"))
    slots = tl.arange(0, KP)
    vals = tl.zeros([KP], dtype=tl.float32)
    ids = tl.zeros([KP], dtype=tl.int32)
    for j in range(k):
        # one (value, index) reduction whose combine prefers the lower index on equal values; the
        # interpreter always breaks ties left (numpy's argmax), so only the CUDA tests prove this rule
        m, at = tl.max(cand, axis=0, return_indices=True, return_indices_tie_break_left=True)
        vals = tl.where(slots == j, m, vals)
        ids = tl.where(slots == j, at, ids)
        cand = tl.where(lanes == at, float("-inf"), cand)
    if NORMALIZE:
        total = tl.sum(vals, axis=0)
        vals = tl.math.div_rn(vals, tl.zeros([KP], dtype=tl.float32) + total)
    # the interpreter's fp32 -> bf16 cast truncates
    if INTERPRET_BF16:
        vals = _round_bf16(vals)
    out = r * k + slots
    written = slots < k
    tl.store(w_ptr + out, vals.to(w_ptr.dtype.element_ty), mask=written)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=written)


@triton.jit
def route_topk_kernel(
    logits_ptr, w_ptr, ids_ptr,
    E, k, s_lr,
    EP: tl.constexpr, KP: tl.constexpr, NORMALIZE: tl.constexpr, INTERPRET_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, EP)
    ok = lanes < E
    x = tl.load(logits_ptr + r * s_lr + lanes, mask=ok, other=float("-inf")).to(tl.float32)
    _select_store(x, ok, lanes, w_ptr, ids_ptr, r, k, KP, NORMALIZE, INTERPRET_BF16)


@triton.jit
def route_topk_partials_kernel(
    part_ptr, w_ptr, ids_ptr, rest_ptr,
    S, E, N, k, s_ps, s_pr, s_rr,
    EP: tl.constexpr, KP: tl.constexpr, BR: tl.constexpr, NORMALIZE: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, EP)
    ok = lanes < E
    row = part_ptr + r * s_pr
    acc = tl.zeros([EP], dtype=tl.float32)
    for s in range(S):
        acc += tl.load(row + s * s_ps + lanes, mask=ok, other=0.0)
    # the logits as the GEMM rounds its output; padding lanes -inf
    x = tl.where(ok, _round_to(acc, w_ptr.dtype.element_ty, INTERPRET_BF16), float("-inf"))
    _select_store(x, ok, lanes, w_ptr, ids_ptr, r, k, KP, NORMALIZE, INTERPRET_BF16)
    # the columns past the experts, BR at a time
    for c0 in range(E, N, BR):
        cols = c0 + tl.arange(0, BR)
        live = cols < N
        tail = tl.zeros([BR], dtype=tl.float32)
        for s in range(S):
            tail += tl.load(row + s * s_ps + cols, mask=live, other=0.0)
        tail = _round_to(tail, rest_ptr.dtype.element_ty, INTERPRET_BF16)
        tl.store(rest_ptr + r * s_rr + (cols - E), tail.to(rest_ptr.dtype.element_ty), mask=live)
