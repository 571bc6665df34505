"""The GDN mixer's one-row verify with its gated RMSNorm as the epilogue (the AR step, T = 1).

One program per (batch row, value head) holds the head's whole output row (`V` columns), so the
per-head norm needs no second pass: the row's output, as `gdn_verify_kernel`'s one-row path
computes it (the factors stored the same way), then transformers' `RMSNormGated`:

    x = o (rounded to the input dtype, as the op's output is)
    y = weight * (x / sqrt(mean(x^2) + eps)).to(input dtype)      (rounded to their product's dtype)
    out = (y * silu(gate)).to(input dtype)                         (the product and silu in fp32)

Why: at one row the norm ran as two inductor kernels after the verify kernel, ~2.1-2.4 us a GDN
layer exposed on an H100 (docs/benchmarks.md, "Where the AR step's time goes"); here it is a few
register ops on the row the program already holds. A row past `num_tokens` gives zeros. Measured on
H100s: the two kernels go, but this one (32 programs, each streaming its head's 64 KB state) takes
about 6.7 us where the verify kernel and the norm took 7.7, and the AR step is no faster beyond
its spread, so `VERIFY_CONFIG["gated_one_row"]` is off (hybridspec/ops/gdn.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.gdn_verify_triton import _verify_one_row, program_heads
from hybridspec.ops.pdl_triton import pdl_enter


@triton.jit
def gdn_verify_gated_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, num_tokens_ptr, gate_ptr, w_ptr,
    o_ptr, z_ptr, kn_ptr, gcum_ptr,
    scale, eps,
    sqb, sqh, skb, skh, svb, svh, sgb, sbb, sgateb, sgateh,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr, USE_L2NORM: tl.constexpr,
    ROUND_INPUT: tl.constexpr, ROUND_PRODUCT: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    i_bh = tl.program_id(0)
    b, h, hk, n = program_heads(i_bh, num_tokens_ptr, 1, HK, HV, HAS_NUM_TOKENS)
    O = _verify_one_row(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, z_ptr, kn_ptr, gcum_ptr,
        0, i_bh, b, h, hk, n, scale, sqb, sqh, skb, skh, svb, svh, sgb, sbb,
        HK, HV, K, V, V, BK, USE_L2NORM,
    )
    dt = o_ptr.dtype.element_ty
    cols = tl.arange(0, V)
    # ROUND_INPUT: the norm reads the verify output in the input dtype (bf16 / fp16)
    x = O
    if ROUND_INPUT:
        x = O.to(dt).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / V + eps)
    if ROUND_INPUT:
        y = y.to(dt).to(tl.float32)
    y = tl.load(w_ptr + cols).to(tl.float32) * y
    # ROUND_PRODUCT: weight and input share the 16-bit dtype, so their product is rounded to it
    if ROUND_PRODUCT:
        y = y.to(dt).to(tl.float32)
    gate = tl.load(gate_ptr + b * sgateb + h * sgateh + cols).to(tl.float32)
    y = y * (gate / (1.0 + tl.exp(-gate)))
    # a row past n: zeros (its gate may hold NaN)
    y = tl.where(0 < n, y, 0.0)
    tl.store(o_ptr + i_bh * V + cols, y.to(dt))
