"""The attention mixer's prologue as one kernel: q and k RMSNorm, rotary embedding, and the new
keys and values written into the KV buffers at the device-resident length.

Under inductor these are four kernels of about a microsecond each (two norms and the rotary as
pointwise / persistent-reduction kernels, the buffer writes as an `index_put`; the AR timeline of
docs/benchmarks.md, "Where the AR step's time goes", 5.2 us exposed a layer on the H100), each
paying a launch's latency for a few kilobytes. Here one program handles one (row, head) vector of D
elements: grid (B * w, Hq + Hkv); programs `h < Hq` norm and rotate query head h into the output,
the others norm and rotate key head `h - Hq` into `keys` and copy its value row into `values`.

The rotation pairs dim d with `d +- R/2` (`rotate_half`), so each program loads its vector twice,
once in order and once at the partner dims, and norms both with the same fp32 scale. Roundings
follow the eager module (`naive_prologue.py`): the normed vector is rounded to the input dtype, and
so are each rotary product and their sum (`_round_to`; an fp32 input rounds nowhere).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.moe_triton import _round_to
from hybridspec.ops.pdl_triton import pdl_enter


@triton.jit
def attention_prologue_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, len_ptr, out_ptr,
    eps, offset,
    s_qb, s_qw, s_qh, s_kb, s_kw, s_kh, s_vb, s_vw, s_vh,
    s_cb, s_cw, s_sb, s_sw,
    s_Kb, s_Kh, s_Kn, s_Vb, s_Vh, s_Vn,
    s_len, s_ob, s_ow, s_oh,
    W: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, R: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    r = tl.program_id(0)
    h = tl.program_id(1)
    b = (r // W).to(tl.int64)
    i = r % W
    d = tl.arange(0, DP)
    d_ok = d < D
    HALF: tl.constexpr = R // 2
    in_rot = d < R
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    partner = tl.where(in_rot, partner, d)
    is_q = h < HQ
    if is_q:
        src = q_ptr + b * s_qb + i * s_qw + h * s_qh
        w_ptr = qw_ptr
    else:
        src = k_ptr + b * s_kb + i * s_kw + (h - HQ) * s_kh
        w_ptr = kw_ptr
    x = tl.load(src + d, mask=d_ok, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    xp = tl.load(src + partner, mask=d_ok, other=0.0).to(tl.float32)
    scale = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    wt = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
    n = _round_to((xf * scale) * (offset + wt), dtype, INTERPRET_BF16)
    npart = _round_to((xp * scale) * (offset + wp), dtype, INTERPRET_BF16)
    rot = tl.where(d < HALF, -npart, npart)
    rmask = d_ok & in_rot
    c = tl.load(cos_ptr + b * s_cb + i * s_cw + d, mask=rmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + b * s_sb + i * s_sw + d, mask=rmask, other=0.0).to(tl.float32)
    y = _round_to(_round_to(n * c, dtype, INTERPRET_BF16) + _round_to(rot * s, dtype, INTERPRET_BF16), dtype,
                  INTERPRET_BF16)
    y = tl.where(in_rot, y, n)
    if is_q:
        tl.store(out_ptr + b * s_ob + i * s_ow + h * s_oh + d, y.to(out_ptr.dtype.element_ty), mask=d_ok)
    else:
        kh = h - HQ
        pos = tl.load(len_ptr + b * s_len).to(tl.int64) + i
        tl.store(keys_ptr + b * s_Kb + kh * s_Kh + pos * s_Kn + d, y.to(keys_ptr.dtype.element_ty), mask=d_ok)
        v = tl.load(v_ptr + b * s_vb + i * s_vw + kh * s_vh + d, mask=d_ok, other=0.0)
        tl.store(values_ptr + b * s_Vb + kh * s_Vh + pos * s_Vn + d, v, mask=d_ok)
