"""Commit of the accepted GDN state for every layer in one launch (docs/design.md, eq. 5).

    S_m = e^{G_m} S_0 + K_{1:m}^T diag(e^{G_m - G_{1:m}}) Z_{1:m}

One program per (value-column tile, layer x batch x value head); m comes from device memory, so one
captured launch serves every accepted length. m = 0 leaves the state as it is.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.pdl_triton import pdl_enter


@triton.jit
def gdn_commit_kernel(
    state_ptr, z_ptr, k_ptr, gcum_ptr, num_commit_ptr,
    B, T,
    szl, skl, sgl,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    i_v = tl.program_id(0)
    i_lbh = tl.program_id(1)
    h = i_lbh % HV
    b = (i_lbh // HV) % B
    layer = i_lbh // (HV * B)
    hk = h // (HV // HK)
    m = tl.load(num_commit_ptr + b).to(tl.int32)

    rows = tl.arange(0, BT)
    cols_k = tl.arange(0, K)
    cols_v = i_v * BV + tl.arange(0, BV)
    take = rows < m

    G = tl.load(gcum_ptr + layer * sgl + (b * T + rows) * HV + h, mask=rows < T, other=0.0)
    G = tl.where(take, G, 0.0)
    G_m = tl.sum(tl.where(rows == m - 1, G, 0.0), axis=0)
    w = tl.exp(tl.where(take, G_m - G, float("-inf")))  # [BT]
    k = tl.load(k_ptr + layer * skl + ((b * T + rows[:, None]) * HK + hk) * K + cols_k[None, :],
                mask=(rows < T)[:, None], other=0.0)
    z = tl.load(z_ptr + layer * szl + ((b * T + rows[:, None]) * HV + h) * V + cols_v[None, :],
                mask=(rows < T)[:, None], other=0.0)
    kw = tl.where(take[:, None], k * w[:, None], 0.0)
    z = tl.where(take[:, None], z, 0.0)

    s_ptrs = state_ptr + i_lbh * K * V + cols_k[:, None] * V + cols_v[None, :]
    S = tl.load(s_ptrs)
    S = tl.exp(G_m) * S + tl.dot(tl.trans(kw), z, input_precision=PRECISION)
    tl.store(s_ptrs, S)
