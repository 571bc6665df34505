"""Token-by-token Gated DeltaNet recurrence (docs/design.md, "GDN verification math", eq. 1): the oracle for every GDN kernel.

Per value head, with the state S of shape [K, V] in fp32:

    S_t = a_t S_{t-1} + k_t z_t^T,   z_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t,   a_t = exp(g_t)

These functions materialise the key-head repeat and may form per-token states; the kernels do neither.
"""

from __future__ import annotations

import torch


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # Same epsilon and form as transformers' `l2norm` (aligned with fla).
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _valid_rows(batch: int, seq: int, num_tokens: torch.Tensor | None, device) -> torch.Tensor:
    t = torch.arange(seq, device=device)
    if num_tokens is None:
        return torch.ones(batch, seq, dtype=torch.bool, device=device)
    return t[None, :] < num_tokens.to(device=device, dtype=torch.long)[:, None]  # [B, T]


def prepare_inputs(q, k, v, g, beta, *, scale=None, use_qk_l2norm=True, num_tokens=None):
    """fp32 copies with rows past `num_tokens` zeroed (NaN-safe), `q, k` normalised and `q` scaled.

    Returns `q, k` as `[B, T, HK, K]`, `v` `[B, T, HV, V]`, `g, beta` `[B, T, HV]`, all fp32.
    A zeroed row leaves the state unchanged and yields z = 0, o = 0.
    """
    B, T = q.shape[:2]
    valid = _valid_rows(B, T, num_tokens, q.device)
    zero = torch.zeros((), device=q.device)

    def clean(x):
        mask = valid.view(B, T, *([1] * (x.dim() - 2)))
        return torch.where(mask, x.float(), zero)

    q, k, v, g, beta = (clean(x) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    return q, k, v, g, beta


def recurrent_states(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=True, num_tokens=None):
    """Run eq. 1 over all T tokens, keeping every per-token state.

    Returns `o` `[B, T, HV, V]` fp32, `z` `[B, T, HV, V]` fp32, normalised `k` `[B, T, HK, K]` fp32,
    `g_cum` `[B, T, HV]` fp32 and `states` `[B, T, HV, K, V]` fp32 (state after token t).
    This is the stock verifier: it writes a full K x V state per token.
    """
    q, k, v, g, beta = prepare_inputs(
        q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, num_tokens=num_tokens
    )
    HK, HV = k.shape[2], v.shape[2]
    qr = q.repeat_interleave(HV // HK, dim=2)
    kr = k.repeat_interleave(HV // HK, dim=2)
    S = state.float().clone()
    o, z, states = [], [], []
    for t in range(q.shape[1]):
        a = g[:, t].exp()[..., None]  # [B, HV, 1]
        kv = torch.einsum("bhk,bhkv->bhv", kr[:, t], S)
        z_t = beta[:, t, :, None] * (v[:, t] - a * kv)
        S = a[..., None] * S + kr[:, t, :, :, None] * z_t[:, :, None, :]
        o.append(torch.einsum("bhk,bhkv->bhv", qr[:, t], S))
        z.append(z_t)
        states.append(S)
    return (
        torch.stack(o, 1),
        torch.stack(z, 1),
        k,
        g.cumsum(1),
        torch.stack(states, 1),
    )


def gdn_verify(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=True, num_tokens=None):
    """Naive twin of `hybridspec.ops.gdn_verify`: `(o, z, k, g_cum)`, `o` in the dtype of `v`."""
    o, z, kn, g_cum, _ = recurrent_states(
        q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm, num_tokens=num_tokens
    )
    return o.to(v.dtype), z, kn, g_cum


def gdn_commit(states, z, k, g_cum, num_commit):
    """Naive twin of `hybridspec.ops.gdn_commit`, in place.

    `states` `[L, B, HV, K, V]`; `z` `[L, B, T, HV, V]`, `k` `[L, B, T, HK, K]`, `g_cum` `[L, B, T, HV]`;
    `num_commit` `[B]`. Applies `S <- exp(g_t) S + k_t z_t^T` for the first `m` tokens, with
    `g_t = G_t - G_{t-1}` recovered from the cumulative decay.
    """
    L, B, T, HV = g_cum.shape
    HK = k.shape[3]
    m = num_commit.to(device=states.device, dtype=torch.long)
    g = torch.diff(g_cum.float(), dim=2, prepend=torch.zeros_like(g_cum[:, :, :1]))
    kr = k.float().repeat_interleave(HV // HK, dim=3)
    S = states.clone()
    for t in range(T):
        take = (t < m).view(1, B, 1, 1, 1)
        nxt = g[:, :, t].exp()[..., None, None] * S + kr[:, :, t, :, :, None] * z[:, :, t, :, None, :].float()
        S = torch.where(take, nxt, S)
    states.copy_(S)


def gated_rms_norm(x, gate, weight, eps):
    """transformers' `RMSNormGated` (Qwen3.5 MoE and Qwen3-Next, silu gate) over the last dim, in
    its order of casts: the statistics in fp32, the normalised row back in `x`'s dtype before the
    weight, the silu gate in fp32, one rounding to `x`'s dtype at the end."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * torch.nn.functional.silu(gate.float())).to(dtype)


def gdn_verify_gated(q, k, v, g, beta, state, gate, weight, eps, *, scale=None, use_qk_l2norm=True, num_tokens=None):
    """Naive twin of `hybridspec.ops.gdn_verify_gated`: `gdn_verify`'s output through
    `gated_rms_norm` per value head (`gate` `[B, T, HV, V]`), rows past `num_tokens` zeros, and the
    factors `(z, k, g_cum)`."""
    o, z, kn, g_cum = gdn_verify(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                 num_tokens=num_tokens)
    valid = _valid_rows(*q.shape[:2], num_tokens, o.device)[..., None, None]
    out = torch.where(valid, gated_rms_norm(o, gate, weight, eps), torch.zeros((), dtype=o.dtype, device=o.device))
    return out, z, kn, g_cum
