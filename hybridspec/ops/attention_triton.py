"""Decode attention of W <= 16 new rows against a KV buffer, split over the context (flash-decoding).

The W rows of a batch row b sit at positions `L .. L + W - 1` (L = `lengths[b]`, on the device);
the buffer already holds their keys and values, and row i sees positions `S .. L + i` (S =
`starts[b]`, the row's left padding, 0 without it), or `S .. L + W - 1` without CAUSAL (the whole
block, as DFlash's draft block sees itself). Only positions below `L + W` are read, in both modes;
no mask over the buffer is built.

Query rows are packed per key head (grouped-query attention): packed row `r = i * G + g` is query
row i of query head `h * G + g`, so each key/value tile is read once for the G heads that share it
and the W rows (FlashInfer's prefill kernels pack `qo_len x group` the same way).

1. `decode_attention_split_kernel`, grid (SPLITS, B * Hkv, row blocks): the context `[0, L + W)` is
   cut into SPLITS ranges of whole BN-position blocks, sized from the device length (so one
   captured launch serves every L, and the work stays spread over the GPU as L grows). Each program
   runs an online softmax over its range for its BM packed rows and stores the normalised partial
   output and its log-sum-exp (base 2) in fp32. Programs whose range is empty exit at once.
2. `decode_attention_combine_kernel`, grid (B * Hkv, W * G): merges the used splits' partials
   (weights `2^(lse_s - max)`), multiplies by `sigmoid(gate)` when given, stores in the output dtype.

Masking follows the project's rule: scores outside a row's causal range become -inf through
`tl.where` before the softmax, and a row with no visible position in a range keeps m = -inf with
`exp2(-inf - 0) = 0` instead of NaN. Loads past `L + W` and before the row's start are masked, so
stale or NaN positions there never enter arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.moe_triton import _round_bf16
from hybridspec.ops.pdl_triton import pdl_enter


@triton.jit
def _split_range(len_ptr, b, s_len, i_s, W: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr):
    """`[start, end)` of split `i_s` over positions `[0, L + W)`, and the number of non-empty splits.
    Splits are whole BN blocks, ceil(blocks / SPLITS) each, so the combine recomputes the count."""
    total = tl.load(len_ptr + b * s_len).to(tl.int32) + W
    blocks = tl.cdiv(total, BN)
    per = tl.cdiv(blocks, SPLITS)
    start = i_s * per * BN
    end = tl.minimum(start + per * BN, total)
    return total, start, end, tl.cdiv(blocks, per)


@triton.jit
def decode_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, start_ptr, o_ptr, lse_ptr,
    scale_log2,
    s_qb, s_qw, s_qh,
    s_kb, s_kh, s_kn,
    s_vb, s_vh, s_vn,
    s_len, s_start,
    W: tl.constexpr, G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, HAS_START: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_m = tl.program_id(2)
    b = i_bh // HKV
    h = i_bh % HKV
    RG: tl.constexpr = W * G
    total, start, end, _ = _split_range(len_ptr, b, s_len, i_s, W, BN, SPLITS)
    if start < end:
        rows = i_m * BM + tl.arange(0, BM)  # packed rows
        qi = rows // G
        row_ok = rows < RG
        d = tl.arange(0, DP)
        d_ok = d < D
        q = tl.load(q_ptr + b.to(tl.int64) * s_qb + qi[:, None] * s_qw + (h * G + rows % G)[:, None] * s_qh
                    + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, DP]
        if UPCAST:
            q = q.to(tl.float32)
        # row i sees positions below L + i + 1 (padding rows: every position of the range); not
        # causal, every row sees the whole block, positions below L + W: the split ranges already
        # end there, so they cover both modes
        if CAUSAL:
            limit = total - W + qi + 1  # [BM]
        else:
            limit = tl.full([BM], 0, dtype=tl.int32) + total
        # left padding: positions before the row's start are masked and not loaded (the split
        # ranges stay length-only: padding is at most the spread of a batch's prompt lengths)
        first = tl.load(start_ptr + b * s_start).to(tl.int32) if HAS_START else 0
        k_base = k_ptr + b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh
        v_base = v_ptr + b.to(tl.int64) * s_vb + h.to(tl.int64) * s_vh
        m = tl.full([BM], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, DP], dtype=tl.float32)
        for n0 in range(start, end, BN):
            pos = n0 + tl.arange(0, BN)
            pos_ok = pos < end
            # positions before the row's start (left padding) are not loaded either: whatever they
            # hold (NaN included) never meets a zero probability in the P @ V product
            kv_mask = (pos_ok & (pos >= first))[:, None] & d_ok[None, :]
            k = tl.load(k_base + pos[:, None].to(tl.int64) * s_kn + d[None, :], mask=kv_mask, other=0.0)  # [BN, DP]
            v = tl.load(v_base + pos[:, None].to(tl.int64) * s_vn + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BM, BN]
            visible = (pos[None, :] < limit[:, None]) & (pos[None, :] >= first) & pos_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # a row with nothing visible yet keeps -inf: subtract 0 there, not -inf
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            # 16-bit values meet 16-bit probabilities on the tensor cores (fp32 accumulation), as in
            # flash attention; the interpreter rounds them the same way and multiplies in fp32
            if ROUND_BF16:
                pv = _round_bf16(p)
            elif UPCAST:
                pv = p.to(v_ptr.dtype.element_ty).to(tl.float32)
            else:
                pv = p.to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
            m = m_new
        has = l > 0
        o = acc / tl.where(has, l, 1.0)[:, None]
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
        part = (i_bh * SPLITS + i_s).to(tl.int64) * RG + rows  # [BM]
        tl.store(o_ptr + part[:, None] * D + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + part, lse, mask=row_ok)


@triton.jit
def decode_attention_combine_kernel(
    o_ptr, lse_ptr, len_ptr, gate_ptr, out_ptr,
    s_len, s_gb, s_gw, s_gh, s_ob, s_ow, s_oh,
    W: tl.constexpr, G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BN: tl.constexpr, SPLITS: tl.constexpr, CS: tl.constexpr,
    HAS_GATE: tl.constexpr, ROUND_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    i_bh = tl.program_id(0)
    r = tl.program_id(1)
    b = i_bh // HKV
    h = i_bh % HKV
    RG: tl.constexpr = W * G
    _, _, _, used = _split_range(len_ptr, b, s_len, 0, W, BN, SPLITS)
    d = tl.arange(0, DP)
    d_ok = d < D
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    total = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([DP], dtype=tl.float32)
    for s0 in range(0, used, CS):
        s = s0 + tl.arange(0, CS)
        ok = s < used
        part = (i_bh * SPLITS + s).to(tl.int64) * RG + r  # [CS]
        lse = tl.load(lse_ptr + part, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        # a split with nothing visible (left padding) has lse = -inf: m_safe keeps it at weight 0;
        # position L + i is always visible (in both modes), so some split is finite and `total` > 0
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        f = tl.exp2(lse - m_safe)  # [CS]
        o = tl.load(o_ptr + part[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha + tl.sum(f[:, None] * o, axis=0)
        total = total * alpha + tl.sum(f, axis=0)
        m = m_new
    out = acc / total
    i = r // G
    head = h * G + r % G
    if HAS_GATE:
        gate = tl.load(gate_ptr + b.to(tl.int64) * s_gb + i * s_gw + head * s_gh + d, mask=d_ok, other=0.0)
        out = out * tl.sigmoid(gate.to(tl.float32))
    if ROUND_BF16:
        out = _round_bf16(out)
    tl.store(out_ptr + b.to(tl.int64) * s_ob + i * s_ow + head * s_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
