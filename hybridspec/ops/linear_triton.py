"""`x @ weight.T` for a few rows (M <= 64): a skinny GEMM whose programs split the output features.

Why: at 1..64 rows against a weight of a few thousand rows (the MoE router and shared expert's
fused gate, the shared expert's down projection, the attention and GDN out projections), cuBLAS
picks tiles so wide along N that the grid has only ~20-30 CTAs on a 132-SM H200, and they stream
the weight at ~0.6 TB/s. Here one program owns BLOCK_N output features, so ~N / BLOCK_N programs
(80-130 at these shapes) read the weight, each its own rows once.

`small_linear_kernel`, grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), splits): each program multiplies
its BLOCK_M rows of `x` (all of them for M <= 64) by a BLOCK_N-row tile of the weight over its
split's `k_span` columns of K (all of K for one split), walking them in BLOCK_K steps with fp32
accumulation, and stores the sum into its split's `[M, N]` slice of the output: rounded once to the
output dtype for `small_linear`, fp32 partial sums for `small_linear_partials`, whose caller adds
the splits in a fixed order (the split-K reduction inside the consumer's own kernel, so no second
launch). Tails of M, N and K are masked loads of zeros. No atomics: each output is summed by one
program in a fixed order, so a result is the same on every run. With programmatic dependent
launch a program waits for the kernel before it (`pdl_enter`).

Why split K at all: at the mixers' output projections (N = 2048, K = 4096) one split gives 128
programs that each walk 16 steps of K, and the step runs at ~40% of the copy bandwidth; splitting K
puts 4x the loads in flight. cuBLAS splits too, but sums its splits in a kernel of its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.moe_triton import _round_bf16
from hybridspec.ops.pdl_triton import pdl_enter


@triton.jit
def small_linear_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K, k_span,
    s_xm, s_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    # this program's split of K: columns [k_lo, k_lo + k_span), a multiple of BLOCK_K wide unless
    # it is the only split (the host's `split_span`), so splits never share a loop step
    k_lo = tl.program_id(2) * k_span
    rows = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    # N x the row stride may pass 2**31 elements (a wide weight, or a slice of a wider fused buffer)
    x_base = x_ptr + rows[:, None].to(tl.int64) * s_xm
    w_base = w_ptr + cols[:, None].to(tl.int64) * s_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_span, BLOCK_K):
        ck = k0 + tl.arange(0, BLOCK_K)
        k_ok = ck < K
        x = tl.load(x_base + ck[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_base + ck[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        # the interpreter multiplies 16-bit dot operands as raw bits: upcast there (exact products)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    # the interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to nearest even
    if INTERPRET_BF16:
        acc = _round_bf16(acc)
    out = out_ptr + (tl.program_id(2) * M + rows[:, None]) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
