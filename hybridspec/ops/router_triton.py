"""The MoE block's first GEMM and the router's selection in one launch, for a few rows (M <= 16).

Why: a decode step's MoE block starts with two launches, the fused GEMM of the router and the
shared expert's gate (`small_linear`) and the router's softmax / top-k (`route_topk`); at one row
each costs a launch and a memory round trip more than its work, 40 layers a step. Here the
second is the tail of the first.

`router_topk_kernel`, grid (cdiv(N, BLOCK_N),): each program computes and stores its BLOCK_N
output features of `logits = x @ w.T` for all M rows, exactly as `small_linear_kernel` does
(`_linear_tile`, the same tiles), then counts itself done on an int32 counter; the program that
counts last routes every row on the first E logits, read back from what the programs stored, as
`route_topk_kernel` reads its input (`_route_rows`; its results do not depend on the layout or the
number of rows per block, see `route_triton.py`), and sets the counter back to 0, so the next
launch (a CUDA graph's replay among them) finds it as this one did. No atomics in the arithmetic:
every value is computed by one program in a fixed order, so the results are the two kernels' bits.

Memory ordering on the GPU (the interpreter runs programs one after another and cannot show it):
a program's threads store their logits, a CTA barrier orders those stores before the one thread
that adds to the counter, and the add is acq_rel at GPU scope: its release publishes the whole
CTA's stores (release is cumulative over what the barrier ordered before it). The last program's
add acquires every earlier release on the counter (they form one chain of read-modify-writes),
and Triton hands the scalar result to the CTA's other threads through shared memory behind a
barrier, so every thread's later loads see all stores. Those loads bypass L1 (`.cg`), which is not
coherent across SMs. The routing outputs are read by later launches, which the stream orders.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.linear_triton import _linear_tile
from hybridspec.ops.route_triton import _route_rows


@triton.jit
def router_topk_kernel(
    x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, counter_ptr,
    M, N, K, E, k,
    s_xm, s_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, INTERPRET_BF16: tl.constexpr,
    RB: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr, NORMALIZE: tl.constexpr,
):
    _linear_tile(x_ptr, w_ptr, logits_ptr, M, N, K, s_xm, s_wn, 0, tl.program_id(0),
                 BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST, INTERPRET_BF16)
    # every thread's stores ordered before the release below
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        # no other program touches the counter again in this launch
        tl.store(counter_ptr, 0)
        for r0 in range(0, M, RB):
            rows = r0 + tl.arange(0, RB).to(tl.int64)
            _route_rows(logits_ptr, weights_ptr, ids_ptr, rows, M, E, k, N,
                        RB, EP, KP, NORMALIZE, INTERPRET_BF16, ".cg")
