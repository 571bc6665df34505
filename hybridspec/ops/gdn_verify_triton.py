"""Block-parallel GDN verification (docs/design.md, eqs. 3 and 4): all w outputs and the compact factors.

One program per (value-column tile, batch x value head). Per program, with T padded to BT = 16:

    (I + A) Z = diag(beta) (V - diag(e^G) K S_0)      (unit lower triangular, w <= 16)
    O = diag(e^G) Q S_0 + (M * Q K^T) Z

Columns of V, Z and O are independent, so each program owns a BV-wide slice of them and recomputes
the tiny T x T matrices. No per-token K x V state is formed.

With PRODUCER (`hybridspec::gdn_conv_verify`, the method's joint producer) the kernel reads the
mixer's pre-conv projections instead of q, k, v, g and beta: each program computes the causal conv
and SiLU of the channels it reads (its key head's q and k columns, its value columns) from the
round's inputs and the layer's conv window, rounded as the module's 16-bit conv and activation
round, and the gates `g = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)` of its head;
it also copies the raw inputs into the round's conv-input buffer that the commit reads. That is
the conv, gate and copy kernels around the verify kernel folded into it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.moe_triton import _round_to
from hybridspec.ops.pdl_triton import pdl_enter


@triton.jit
def _conv_silu(m_base, smt, w_base, swc, cw_ptr, cb_ptr, rows, chans, T,
               BT: tl.constexpr, BC: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
               INTERPRET_BF16: tl.constexpr):
    """`silu(conv)` `[BT, BC]` fp32 of channels `chans` at rows `rows`: output t of channel c is
    sum_j full[t + 1 + j, c] * weight[c, j] over the KW taps, `full` the window `[C, KW]` followed by
    the round's inputs `[T, C]`, summed in fp32 in tap order, then rounded to the weight's dtype,
    activated and rounded again (transformers' 16-bit conv and SiLU)."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KW):
        # the input row feeding tap j of output row t; negative: window column KW + s
        s = rows + (j + 1 - KW)
        before = s < 0
        x_in = tl.load(m_base + s[:, None] * smt + chans[None, :], mask=((s >= 0) & (s < T))[:, None], other=0.0)
        x_win = tl.load(w_base + chans[None, :] * swc + (s + KW)[:, None], mask=before[:, None], other=0.0)
        x = tl.where(before[:, None], x_win, x_in).to(tl.float32)
        acc += x * tl.load(cw_ptr + chans * KW + j).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(cb_ptr + chans).to(tl.float32)[None, :]
    dt = cw_ptr.dtype.element_ty
    y = _round_to(acc, dt, INTERPRET_BF16)
    return _round_to(y * tl.sigmoid(y), dt, INTERPRET_BF16)


@triton.jit
def _softplus(x):
    """torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x)), the log1p exact
    to rounding where 1 + e^x rounds (log(u) * e / (u - 1), Goldberg's form)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    lp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def gdn_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, num_tokens_ptr,
    o_ptr, z_ptr, kn_ptr, gcum_ptr,
    win_ptr, cw_ptr, cb_ptr, alog_ptr, dtb_ptr, in_ptr,
    T, scale,
    sqb, sqt, sqh,
    skb, skt, skh,
    svb, svt, svh,
    sgb, sgt,
    sbb, sbt,
    swb, swc, sib, sic,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr, USE_L2NORM: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    PRODUCER: tl.constexpr = False, KW: tl.constexpr = 4, HAS_BIAS: tl.constexpr = False,
    INTERPRET_BF16: tl.constexpr = False,
):
    # With PRODUCER, q_ptr is the pre-conv inputs [B, T, C] (strides sqb, sqt; channels q, k, v in
    # that order), g_ptr and beta_ptr the raw gate projections a and b; k_ptr and v_ptr are unused.
    pdl_enter(USE_PDL)
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // HV
    h = i_bh % HV
    # value head h reads key head h // (HV // HK), as transformers' repeat_interleave does
    hk = h // (HV // HK)
    if HAS_NUM_TOKENS:
        n = tl.load(num_tokens_ptr + b).to(tl.int32)
    else:
        n = T

    rows = tl.arange(0, BT)
    cols_v = i_v * BV + tl.arange(0, BV)
    in_bounds = rows < T
    # rows past n may hold NaN: select zeros with where (0 * NaN is NaN)
    valid = rows < n

    m_base = q_ptr + b * sqb
    w_base = win_ptr + b * swb
    if PRODUCER:
        a = tl.load(g_ptr + b * sgb + rows * sgt + h, mask=in_bounds, other=0.0).to(tl.float32)
        a = a + tl.load(dtb_ptr + h).to(tl.float32)
        g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * _softplus(a)
        beta = tl.load(beta_ptr + b * sbb + rows * sbt + h, mask=in_bounds, other=0.0).to(tl.float32)
        beta = _round_to(tl.sigmoid(beta), beta_ptr.dtype.element_ty, INTERPRET_BF16)
        chans_v = 2 * HK * K + h * V + cols_v
        v = _conv_silu(m_base, sqt, w_base, swc, cw_ptr, cb_ptr, rows, chans_v, T, BT, BV, KW, HAS_BIAS,
                       INTERPRET_BF16)
        # the round's raw inputs for the commit: each value column by its own program
        raw = tl.load(m_base + rows[:, None] * sqt + chans_v[None, :], mask=in_bounds[:, None])
        tl.store(in_ptr + b * sib + chans_v[None, :] * sic + rows[:, None], raw, mask=in_bounds[:, None])
    else:
        g = tl.load(g_ptr + b * sgb + rows * sgt + h, mask=in_bounds, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + b * sbb + rows * sbt + h, mask=in_bounds, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b * svb + rows[:, None] * svt + h * svh + cols_v[None, :],
                    mask=in_bounds[:, None], other=0.0).to(tl.float32)
    g = tl.where(valid, g, 0.0)
    beta = tl.where(valid, beta, 0.0)
    v = tl.where(valid[:, None], v, 0.0)

    # Products with raw q, k over BK-wide slices of the head dim (few registers live at a time);
    # the l2 normalisation is a row/column scaling applied afterwards.
    q_base = q_ptr + b * sqb + rows[:, None] * sqt + hk * sqh
    k_base = k_ptr + b * skb + rows[:, None] * skt + hk * skh
    s_base = state_ptr + i_bh * K * V + cols_v[None, :]
    KS = tl.zeros([BT, BV], dtype=tl.float32)
    QS = tl.zeros([BT, BV], dtype=tl.float32)
    KK = tl.zeros([BT, BT], dtype=tl.float32)
    QK = tl.zeros([BT, BT], dtype=tl.float32)
    qq = tl.zeros([BT], dtype=tl.float32)
    kk = tl.zeros([BT], dtype=tl.float32)
    for c in tl.static_range(0, K, BK):
        cols_k = c + tl.arange(0, BK)
        if PRODUCER:
            q = _conv_silu(m_base, sqt, w_base, swc, cw_ptr, cb_ptr, rows, hk * K + cols_k, T, BT, BK, KW,
                           HAS_BIAS, INTERPRET_BF16)
            k = _conv_silu(m_base, sqt, w_base, swc, cw_ptr, cb_ptr, rows, (HK + hk) * K + cols_k, T, BT, BK,
                           KW, HAS_BIAS, INTERPRET_BF16)
        else:
            q = tl.load(q_base + cols_k[None, :], mask=in_bounds[:, None], other=0.0).to(tl.float32)
            k = tl.load(k_base + cols_k[None, :], mask=in_bounds[:, None], other=0.0).to(tl.float32)
        q = tl.where(valid[:, None], q, 0.0)
        k = tl.where(valid[:, None], k, 0.0)
        S0 = tl.load(s_base + cols_k[:, None] * V)  # [BK, BV]
        KS += tl.dot(k, S0, input_precision=PRECISION)
        QS += tl.dot(q, S0, input_precision=PRECISION)
        KK += tl.dot(k, tl.trans(k), input_precision=PRECISION)
        QK += tl.dot(q, tl.trans(k), input_precision=PRECISION)
        qq += tl.sum(q * q, axis=1)
        kk += tl.sum(k * k, axis=1)
    if USE_L2NORM:
        rq = tl.rsqrt(qq + 1e-6) * scale
        rk = tl.rsqrt(kk + 1e-6)
    else:
        rq = tl.zeros([BT], dtype=tl.float32) + scale
        rk = tl.zeros([BT], dtype=tl.float32) + 1.0
    KS = KS * rk[:, None]
    QS = QS * rq[:, None]
    KK = KK * rk[:, None] * rk[None, :]
    QK = QK * rq[:, None] * rk[None, :]

    G = tl.cumsum(g, axis=0)  # [BT]
    # mask the exponent before exp: e^{G_i - G_j} for j > i overflows under strong decay
    diff = G[:, None] - G[None, :]
    causal = rows[:, None] >= rows[None, :]
    decay = tl.exp(tl.where(causal, diff, float("-inf")))  # [BT, BT]
    eG = tl.exp(G)

    rhs = beta[:, None] * (v - eG[:, None] * KS)
    strict = rows[:, None] > rows[None, :]
    A = tl.where(strict, beta[:, None] * KK * decay, 0.0)

    # Forward substitution as Z <- rhs - A Z: A is strictly lower triangular, so after i sweeps
    # rows 0..i are final and each row is computed exactly as in row-by-row substitution.
    Z = rhs
    for _ in range(1, n):
        Z = rhs - tl.dot(A, Z, input_precision=PRECISION)

    O = eG[:, None] * QS + tl.dot(QK * decay, Z, input_precision=PRECISION)

    out_rows = (b * T + rows[:, None]) * HV + h
    tl.store(o_ptr + out_rows * V + cols_v[None, :], O.to(o_ptr.dtype.element_ty), mask=in_bounds[:, None])
    tl.store(z_ptr + out_rows * V + cols_v[None, :], Z, mask=in_bounds[:, None])
    if i_v == 0:
        tl.store(gcum_ptr + (b * T + rows) * HV + h, G, mask=in_bounds)
        if h % (HV // HK) == 0:
            kn_rows = (b * T + rows[:, None]) * HK + hk
            for c in tl.static_range(0, K, BK):
                cols_k = c + tl.arange(0, BK)
                if PRODUCER:
                    k = _conv_silu(m_base, sqt, w_base, swc, cw_ptr, cb_ptr, rows, (HK + hk) * K + cols_k, T, BT,
                                   BK, KW, HAS_BIAS, INTERPRET_BF16)
                    # this key head's raw q and k inputs for the commit, by one program of the head
                    for off in tl.static_range(0, 2):
                        chans = (off * HK + hk) * K + cols_k
                        raw_qk = tl.load(m_base + rows[:, None] * sqt + chans[None, :], mask=in_bounds[:, None])
                        tl.store(in_ptr + b * sib + chans[None, :] * sic + rows[:, None], raw_qk,
                                 mask=in_bounds[:, None])
                else:
                    k = tl.load(k_base + cols_k[None, :], mask=in_bounds[:, None], other=0.0).to(tl.float32)
                k = tl.where(valid[:, None], k, 0.0) * rk[:, None]
                tl.store(kn_ptr + kn_rows * K + cols_k[None, :], k, mask=in_bounds[:, None])
