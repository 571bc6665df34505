"""Block-parallel GDN verification (docs/design.md, eqs. 3 and 4): all w outputs and the compact factors.

One program per (value-column tile, batch x value head). Per program, with T padded to BT = 16:

    (I + A) Z = diag(beta) (V - diag(e^G) K S_0)      (unit lower triangular, w <= 16)
    O = diag(e^G) Q S_0 + (M * Q K^T) Z

Columns of V, Z and O are independent, so each program owns a BV-wide slice of them and recomputes
the tiny T x T matrices. No per-token K x V state is formed.

With `VERIFY_CONFIG["one_row"]` on, the autoregressive step (T = 1) takes `ONE_ROW`: the same
outputs from fp32 multiplies and sums over the key dim, with no padding, dots or substitution,

    z = beta (v - e^g k^T S_0),   o = e^g S_0^T q + (q^T k) z     (q, k normalised and scaled)

because at T = 1 the 16-row path took ~5.7 us a layer on an H100 where reading the 2 MB fp32 state
needs ~0.6 us: padded tf32x3 dots, layout conversions and the substitution are latency on one row.
With rows alternated the AR step ran ~1.5% faster with it in four H100 processes, and the GPU
exactness tests pass with it, so it is on by default (hybridspec/ops/gdn.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.pdl_triton import pdl_enter


@triton.jit
def program_heads(i_bh, num_tokens_ptr, T, HK: tl.constexpr, HV: tl.constexpr, HAS_NUM_TOKENS: tl.constexpr):
    """A program's batch row `b`, value head `h`, key head `hk` and row count `n` from its
    (batch x value head) index."""
    b = i_bh // HV
    h = i_bh % HV
    # value head h reads key head h // (HV // HK), as transformers' repeat_interleave does
    hk = h // (HV // HK)
    if HAS_NUM_TOKENS:
        n = tl.load(num_tokens_ptr + b).to(tl.int32)
    else:
        n = T
    return b, h, hk, n


@triton.jit
def _verify_one_row(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, z_ptr, kn_ptr, gcum_ptr,
    i_v, i_bh, b, h, hk, n, scale, sqb, sqh, skb, skh, svb, svh, sgb, sbb,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    USE_L2NORM: tl.constexpr,
):
    """`gdn_verify_kernel` at T = 1: stores the row's factors and returns its output `[BV]` (fp32),
    zeros if the row is past n (n = 0); the caller stores it (`gdn_verify_kernel`) or normalises it
    first (`gdn_verify_gated_triton.py`)."""
    cols_v = i_v * BV + tl.arange(0, BV)
    # a row past n may hold NaN: select zeros with where (0 * NaN is NaN)
    valid = 0 < n
    g = tl.where(valid, tl.load(g_ptr + b * sgb + h).to(tl.float32), 0.0)
    beta = tl.where(valid, tl.load(beta_ptr + b * sbb + h).to(tl.float32), 0.0)
    v = tl.where(valid, tl.load(v_ptr + b * svb + h * svh + cols_v).to(tl.float32), 0.0)

    # Elementwise products summed once after the loop: one cross-thread reduction per output
    q_base = q_ptr + b * sqb + hk * sqh
    k_base = k_ptr + b * skb + hk * skh
    s_base = state_ptr + i_bh * K * V + cols_v[None, :]
    kS = tl.zeros([BK, BV], dtype=tl.float32)
    qS = tl.zeros([BK, BV], dtype=tl.float32)
    qk = tl.zeros([BK], dtype=tl.float32)
    qq = tl.zeros([BK], dtype=tl.float32)
    kk = tl.zeros([BK], dtype=tl.float32)
    for c in tl.static_range(0, K, BK):
        cols_k = c + tl.arange(0, BK)
        q = tl.where(valid, tl.load(q_base + cols_k).to(tl.float32), 0.0)
        k = tl.where(valid, tl.load(k_base + cols_k).to(tl.float32), 0.0)
        S0 = tl.load(s_base + cols_k[:, None] * V)  # [BK, BV]
        kS += k[:, None] * S0
        qS += q[:, None] * S0
        qk += q * k
        qq += q * q
        kk += k * k
    if USE_L2NORM:
        rq = tl.rsqrt(tl.sum(qq, axis=0) + 1e-6) * scale
        rk = tl.rsqrt(tl.sum(kk, axis=0) + 1e-6)
    else:
        rq = scale
        rk = 1.0
    KS = tl.sum(kS, axis=0) * rk  # [BV]
    QS = tl.sum(qS, axis=0) * rq
    QK = tl.sum(qk, axis=0) * rq * rk

    eG = tl.exp(g)
    Z = beta * (v - eG * KS)
    O = eG * QS + QK * Z

    # T = 1: output row (b, 0, h) is row i_bh of o and z, entry i_bh of g_cum, key row b HK + hk
    tl.store(z_ptr + i_bh * V + cols_v, Z)
    if i_v == 0:
        tl.store(gcum_ptr + i_bh, g)
        if h % (HV // HK) == 0:
            for c in tl.static_range(0, K, BK):
                cols_k = c + tl.arange(0, BK)
                k = tl.where(valid, tl.load(k_base + cols_k).to(tl.float32), 0.0) * rk
                tl.store(kn_ptr + (b * HK + hk) * K + cols_k, k)
    return O


@triton.jit
def gdn_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, num_tokens_ptr,
    o_ptr, z_ptr, kn_ptr, gcum_ptr,
    T, scale,
    sqb, sqt, sqh,
    skb, skt, skh,
    svb, svt, svh,
    sgb, sgt,
    sbb, sbt,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr, USE_L2NORM: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    ONE_ROW: tl.constexpr,
):
    pdl_enter(USE_PDL)
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b, h, hk, n = program_heads(i_bh, num_tokens_ptr, T, HK, HV, HAS_NUM_TOKENS)

    if ONE_ROW:
        O = _verify_one_row(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, z_ptr, kn_ptr, gcum_ptr,
            i_v, i_bh, b, h, hk, n, scale, sqb, sqh, skb, skh, svb, svh, sgb, sbb,
            HK, HV, K, V, BV, BK, USE_L2NORM,
        )
        tl.store(o_ptr + i_bh * V + i_v * BV + tl.arange(0, BV), O.to(o_ptr.dtype.element_ty))
        return

    rows = tl.arange(0, BT)
    cols_v = i_v * BV + tl.arange(0, BV)
    in_bounds = rows < T
    # rows past n may hold NaN: select zeros with where (0 * NaN is NaN)
    valid = rows < n

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
                k = tl.load(k_base + cols_k[None, :], mask=in_bounds[:, None], other=0.0).to(tl.float32)
                k = tl.where(valid[:, None], k, 0.0) * rk[:, None]
                tl.store(kn_ptr + kn_rows * K + cols_k[None, :], k, mask=in_bounds[:, None])
