"""The GDN mixer from its pre-conv projection in one launch: causal conv, SiLU, gates and the
block-parallel verification (`gdn_verify_triton.py`).

Same grid as `gdn_verify_kernel`, one program per (value-column tile, batch x value head). Where
that kernel loads q, k, v, g and beta, this one computes them from the projection output `mixed`
`[B, T, C]` (channels q | k | v), the layer's conv window `[B, C, KW]` and the raw gate inputs
`a, b` `[B, T, HV]`, with the unfused path's roundings (`naive_gdn_conv.py`):

    x_t = round_w(sum_j cat(window, mixed)[t + 1 + j] * w_j + bias)   fp32 sum in tap order
    q | k | v = round_x(round_w(silu(x)))                             w: weight dtype, x: mixed's
    beta = round_b(sigmoid(b)),  g = -exp(A_log) * softplus(a + dt_bias)   (fp32, threshold 20)

Every program computes the conv of its key head's q and k channels (BK at a time) and of its own
BV-wide slice of v; the products and the solve are the verify kernel's helpers. The round's raw
inputs go to `inputs` `[B, C, W]` (the commit rolls the window with them), each channel once: q and
k channels from the programs of the first column tile of each key head's first value head, v
channels from each program's slice.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.gdn_verify_triton import _accumulate, _solve, _store_key
from hybridspec.ops.moe_triton import _round_bf16

# torch's softplus threshold: above it softplus(x) is x
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


@triton.jit
def _round_as(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 `x` rounded to `dtype` and back; the interpreter's fp32 -> bf16 cast truncates, so under
    it bf16 rounds explicitly (the GPU's cast rounds to nearest even)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            return _round_bf16(x)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _log1p(y):
    """log(1 + y) for y >= 0, accurate where 1 + y rounds (Goldberg's correction): Triton has no
    log1p outside libdevice, which the interpreter cannot run."""
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, rows, T, sat, sbt, INTERPRET: tl.constexpr):
    """`g` fp32 and `beta` (rounded to b's dtype, as fp32) `[BT]` of one head; rows at or past T are
    loaded as zeros (the caller selects the valid rows)."""
    in_bounds = rows < T
    a = tl.load(a_ptr + rows * sat, mask=in_bounds, other=0.0).to(tl.float32)
    braw = tl.load(b_ptr + rows * sbt, mask=in_bounds, other=0.0).to(tl.float32)
    x = a + tl.load(dtb_ptr).to(tl.float32)
    # the exponent clamped where the threshold selects x anyway (no inf in the unused branch)
    softplus = tl.where(x > SOFTPLUS_THRESHOLD, x, _log1p(tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))))
    g = -tl.exp(tl.load(alog_ptr).to(tl.float32)) * softplus
    beta = _round_as(tl.sigmoid(braw), b_ptr.dtype.element_ty, INTERPRET)
    return g, beta


@triton.jit
def _tap(mixed_ptr, window_ptr, cw_ptr, chans, rows, T, smt, swc, swk, scw_c, scw_k, j: tl.constexpr,
         KW: tl.constexpr):
    """Tap j's products `[BT, BC]` in fp32: row t reads position p = t + 1 + j of cat(window, mixed),
    window column p below KW, else mixed row p - KW <= t; rows at or past T read zeros."""
    in_bounds = (rows < T)[:, None]
    p = (rows + 1 + j)[:, None]
    from_window = tl.load(window_ptr + chans[None, :] * swc + p * swk, mask=in_bounds & (p < KW), other=0.0)
    from_mixed = tl.load(mixed_ptr + (p - KW) * smt + chans[None, :], mask=in_bounds & (p >= KW), other=0.0)
    x = tl.where(p < KW, from_window.to(tl.float32), from_mixed.to(tl.float32))
    return x * tl.load(cw_ptr + chans * scw_c + j * scw_k).to(tl.float32)[None, :]


@triton.jit
def _conv_silu(mixed_ptr, window_ptr, cw_ptr, cb_ptr, chans, rows, T,
               smt, swc, swk, scw_c, scw_k,
               KW: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    """Channels `chans` `[BC]` of rows `rows` `[BT]` after the causal conv and SiLU, fp32 holding
    values of mixed's dtype `[BT, BC]`; `mixed_ptr` and `window_ptr` point at the batch row. Rows at
    or past T come from zeros (and the bias): the caller never uses them."""
    # summed in tap order, as the unfused path's fp32 sum
    acc = _tap(mixed_ptr, window_ptr, cw_ptr, chans, rows, T, smt, swc, swk, scw_c, scw_k, 0, KW)
    for j in tl.static_range(1, KW):
        acc = acc + _tap(mixed_ptr, window_ptr, cw_ptr, chans, rows, T, smt, swc, swk, scw_c, scw_k, j, KW)
    if HAS_BIAS:
        acc = acc + tl.load(cb_ptr + chans).to(tl.float32)[None, :]
    # conv1d rounds its accumulator to the weight's dtype; SiLU computes in fp32 and rounds to its
    # input's dtype; the unfused path's cast then takes it to the activations' dtype
    x = _round_as(acc, cw_ptr.dtype.element_ty, INTERPRET)
    x = _round_as(x / (1.0 + tl.exp(-x)), cw_ptr.dtype.element_ty, INTERPRET)
    return _round_as(x, mixed_ptr.dtype.element_ty, INTERPRET)


@triton.jit
def _keep_inputs(mixed_ptr, inputs_ptr, chans, rows, T, smt, sic):
    """Copy rows `rows` of channels `chans` of `mixed` into columns `rows` of `inputs` (both at the batch row)."""
    mask = (rows < T)[:, None]
    x = tl.load(mixed_ptr + rows[:, None] * smt + chans[None, :], mask=mask)
    tl.store(inputs_ptr + chans[None, :] * sic + rows[:, None], x, mask=mask)


@triton.jit
def gdn_conv_verify_kernel(
    mixed_ptr, window_ptr, cw_ptr, cb_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, num_tokens_ptr,
    inputs_ptr, o_ptr, z_ptr, kn_ptr, gcum_ptr,
    T, scale,
    smb, smt,
    swb, swc, swk,
    scw_c, scw_k,
    sab, sat,
    sbb, sbt,
    sib, sic,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KW: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_NUM_TOKENS: tl.constexpr, USE_L2NORM: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // HV
    h = i_bh % HV
    # value head h reads key head h // (HV // HK), as transformers' repeat_interleave does
    hk = h // (HV // HK)
    # at most T: rows past T are computed (from zeros, plus the bias) and must not count
    n = T
    if HAS_NUM_TOKENS:
        n = tl.minimum(tl.load(num_tokens_ptr + b).to(tl.int32), T)

    rows = tl.arange(0, BT)
    cols_v = i_v * BV + tl.arange(0, BV)
    # rows past n may hold NaN: select zeros with where (0 * NaN is NaN)
    valid = rows < n
    mixed_b = mixed_ptr + b * smb
    window_b = window_ptr + b * swb
    inputs_b = inputs_ptr + b * sib
    leads_key_head = (i_v == 0) & (h % (HV // HK) == 0)

    g, beta = _gates(a_ptr + b * sab + h, b_ptr + b * sbb + h, alog_ptr + h, dtb_ptr + h, rows, T, sat, sbt,
                     INTERPRET)
    g = tl.where(valid, g, 0.0)
    beta = tl.where(valid, beta, 0.0)
    chans_v = 2 * HK * K + h * V + cols_v
    v = _conv_silu(mixed_b, window_b, cw_ptr, cb_ptr, chans_v, rows, T, smt, swc, swk, scw_c, scw_k,
                   KW, HAS_BIAS, INTERPRET)
    v = tl.where(valid[:, None], v, 0.0)
    _keep_inputs(mixed_b, inputs_b, chans_v, rows, T, smt, sic)

    s_base = state_ptr + i_bh * K * V + cols_v[None, :]
    KS = tl.zeros([BT, BV], dtype=tl.float32)
    QS = tl.zeros([BT, BV], dtype=tl.float32)
    KK = tl.zeros([BT, BT], dtype=tl.float32)
    QK = tl.zeros([BT, BT], dtype=tl.float32)
    qq = tl.zeros([BT], dtype=tl.float32)
    kk = tl.zeros([BT], dtype=tl.float32)
    for c in tl.static_range(0, K, BK):
        chans_q = hk * K + c + tl.arange(0, BK)
        chans_k = HK * K + chans_q
        q = _conv_silu(mixed_b, window_b, cw_ptr, cb_ptr, chans_q, rows, T, smt, swc, swk, scw_c, scw_k,
                       KW, HAS_BIAS, INTERPRET)
        k = _conv_silu(mixed_b, window_b, cw_ptr, cb_ptr, chans_k, rows, T, smt, swc, swk, scw_c, scw_k,
                       KW, HAS_BIAS, INTERPRET)
        q = tl.where(valid[:, None], q, 0.0)
        k = tl.where(valid[:, None], k, 0.0)
        if leads_key_head:
            _keep_inputs(mixed_b, inputs_b, chans_q, rows, T, smt, sic)
            _keep_inputs(mixed_b, inputs_b, chans_k, rows, T, smt, sic)
        S0 = tl.load(s_base + (c + tl.arange(0, BK))[:, None] * V)  # [BK, BV]
        KS, QS, KK, QK, qq, kk = _accumulate(q, k, S0, KS, QS, KK, QK, qq, kk, PRECISION)
    rk = _solve(g, beta, v, KS, QS, KK, QK, qq, kk, n, scale, b, h, i_v, T, o_ptr, z_ptr, gcum_ptr,
                HV, V, BT, BV, USE_L2NORM, PRECISION)
    if leads_key_head:
        # the normalised keys: the conv again (cheaper than keeping K columns of keys live)
        for c in tl.static_range(0, K, BK):
            chans_k = HK * K + hk * K + c + tl.arange(0, BK)
            k = _conv_silu(mixed_b, window_b, cw_ptr, cb_ptr, chans_k, rows, T, smt, swc, swk, scw_c, scw_k,
                           KW, HAS_BIAS, INTERPRET)
            _store_key(kn_ptr, tl.where(valid[:, None], k, 0.0) * rk[:, None], b, hk, rows,
                       c + tl.arange(0, BK), T, HK, K)
