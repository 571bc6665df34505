"""The MoE router's post-GEMM work in one kernel: fp32 softmax over a row's E logits, the k largest
probabilities in descending order, optionally renormalised, cast to the logits' dtype.
`route_topk_partials_kernel` first adds the router GEMM's split-K partial sums (s = 0, 1, ... in
order, fp32) and rounds them to the logits' dtype, as the GEMM's own output is rounded; the columns
past the E experts (the block's other fused rows: the shared expert's gate) it adds, rounds and
stores for their consumer.

`route_topk_kernel`, grid (R,): one program holds one row, E padded to the power of two EP (padding
lanes are -inf logits, probability 0, and never chosen before a real expert: k <= E). Softmax:
`p = e^(l - max) / sum e^(l - max)` (IEEE division). Then K rounds (K = k, unrolled up to 16) of
one integer max each over keys `bits(p) * 2^32 + (EP - 1 - lane)`: a probability is >= 0, so its
fp32 bits order like the value, and equal probabilities order by the lower lane, so the maximum key
is the largest remaining probability at its lowest lane (the order of a stable descending sort,
ties to the lowest index), every key distinct; the chosen lane's key becomes -1, below every real
one, as padding lanes start. One 64-bit max a round (two `redux.sync` on sm90), where a (value,
index) reduction carried two values through five shuffle levels. The chosen values are summed in
fp32 (slots past k hold 0), each divided by the sum (IEEE division, as torch divides), then cast.

The partials kernel issues every load before its first reduction: the S splits of the logits and of
the first BR columns past the experts in one unrolled pass (S a compile-time constant), one round
trip to L2 where a loop over S made S of them, and S more for those columns after the selection.
On an H100 the kernel alone went from 6.6 to 6.0 us and the AR step from 3.471 to 3.443 ms
(docs/benchmarks.md, "One-row kernels under Nsight Compute; the router's top-k").
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.moe_triton import _round_bf16, _round_to
from hybridspec.ops.pdl_triton import pdl_enter


# the models' k (8 and 10) and anything up to 16 take the rounds unrolled; a larger k (the wrapper
# allows up to E = 1024) loops, so no kernel unrolls a thousand rounds
UNROLL_K = tl.constexpr(16)


@triton.jit
def _take(key, vals, ids, slots, j, EP: tl.constexpr):
    """Round j: the largest remaining key into slot j (its probability and lane), then retired."""
    m = tl.max(key, axis=0)
    vals = tl.where(slots == j, (m >> 32).to(tl.int32).to(tl.float32, bitcast=True), vals)
    ids = tl.where(slots == j, EP - 1 - (m & 0xFFFFFFFF).to(tl.int32), ids)
    return tl.where(key == m, -1, key), vals, ids


@triton.jit
def _select_store(x, ok, lanes, w_ptr, ids_ptr, r,
                  EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NORMALIZE: tl.constexpr,
                  INTERPRET_BF16: tl.constexpr):
    """Row r's softmax over its fp32 logits `x` `[EP]` (-inf on padding lanes), the top K, stored."""
    e = tl.exp(x - tl.max(x, axis=0))
    p = tl.math.div_rn(e, tl.sum(e, axis=0))
    # keys: the probability's bits (>= 0, so they order like the value) above the reversed lane;
    # padding lanes -1, below every real expert, an underflowed one included
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) + (EP - 1 - lanes)
    key = tl.where(ok, key, -1)
    slots = tl.arange(0, KP)
    vals = tl.zeros([KP], dtype=tl.float32)
    ids = tl.zeros([KP], dtype=tl.int32)
    if K <= UNROLL_K:
        for j in tl.static_range(K):
            key, vals, ids = _take(key, vals, ids, slots, j, EP)
    else:
        for j in range(K):
            key, vals, ids = _take(key, vals, ids, slots, j, EP)
    if NORMALIZE:
        total = tl.sum(vals, axis=0)
        vals = tl.math.div_rn(vals, tl.zeros([KP], dtype=tl.float32) + total)
    # the interpreter's fp32 -> bf16 cast truncates
    if INTERPRET_BF16:
        vals = _round_bf16(vals)
    out = r * K + slots
    written = slots < K
    tl.store(w_ptr + out, vals.to(w_ptr.dtype.element_ty), mask=written)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=written)


@triton.jit
def route_topk_kernel(
    logits_ptr, w_ptr, ids_ptr,
    E, s_lr,
    EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NORMALIZE: tl.constexpr, INTERPRET_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, EP)
    ok = lanes < E
    x = tl.load(logits_ptr + r * s_lr + lanes, mask=ok, other=float("-inf")).to(tl.float32)
    _select_store(x, ok, lanes, w_ptr, ids_ptr, r, EP, K, KP, NORMALIZE, INTERPRET_BF16)


@triton.jit
def _rest_store(tail, rest_ptr, r, s_rr, cols, live, E, INTERPRET_BF16: tl.constexpr):
    """The columns past the experts, summed over the splits in fp32, rounded as the GEMM rounds."""
    tail = _round_to(tail, rest_ptr.dtype.element_ty, INTERPRET_BF16)
    tl.store(rest_ptr + r * s_rr + (cols - E), tail.to(rest_ptr.dtype.element_ty), mask=live)


@triton.jit
def _split_sum(row, s_ps, offs, mask, S: tl.constexpr, WIDTH: tl.constexpr):
    """Columns `offs` of a row's S split-K partials added in fp32, s = 0, 1, ... in order (unrolled:
    the S loads are issued together)."""
    acc = tl.zeros([WIDTH], dtype=tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(row + s * s_ps + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def route_topk_partials_kernel(
    part_ptr, w_ptr, ids_ptr, rest_ptr,
    E, N, s_ps, s_pr, s_rr,
    S: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BR: tl.constexpr,
    NORMALIZE: tl.constexpr, INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, EP)
    ok = lanes < E
    row = part_ptr + r * s_pr
    # every split of the logits and of the first BR columns past them, loaded before any reduction
    cols = E + tl.arange(0, BR)
    live = cols < N
    acc = _split_sum(row, s_ps, lanes, ok, S, EP)
    tail = _split_sum(row, s_ps, cols, live, S, BR)
    # the logits as the GEMM rounds its output; padding lanes -inf
    x = tl.where(ok, _round_to(acc, w_ptr.dtype.element_ty, INTERPRET_BF16), float("-inf"))
    _select_store(x, ok, lanes, w_ptr, ids_ptr, r, EP, K, KP, NORMALIZE, INTERPRET_BF16)
    _rest_store(tail, rest_ptr, r, s_rr, cols, live, E, INTERPRET_BF16)
    # any further columns, BR at a time (the models' blocks have one: the shared expert's gate)
    for c0 in range(E + BR, N, BR):
        cols = c0 + tl.arange(0, BR)
        live = cols < N
        tail = _split_sum(row, s_ps, cols, live, S, BR)
        _rest_store(tail, rest_ptr, r, s_rr, cols, live, E, INTERPRET_BF16)
