"""The GDN mixer's elementwise work before the recurrence, as transformers' single-step update computes it:
the causal depthwise conv over the layer's window and the round's inputs, the SiLU, the gates. With
`naive.gdn_verify` after them, the oracle for `hybridspec.ops.gdn_conv_verify`; the unfused
verification path (`patches/common.py`) runs the same functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridspec.ops import naive


def causal_conv(window: torch.Tensor, mixed: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv of `mixed` `[B, C, w]` after `window` `[B, C, KW]` with `weight`
    `[C, KW]` (and `bias` `[C]`), before the activation, in the weight's dtype `[B, C, w]`.

    Output t reads `cat(window, mixed)[..., t + 1 .. t + KW]`: the conv as KW shifted products
    summed in fp32 in tap order and rounded once to the weight's dtype, as a 16-bit conv1d rounds
    its fp32 accumulator. Elementwise work that inductor fuses with the activation and the split
    after it, where F.conv1d (and its im2col on some backends) is a launch of its own."""
    w = mixed.shape[-1]
    taps = weight.float()
    KW = taps.shape[-1]
    full = torch.cat([window, mixed], dim=-1).float()  # [B, C, KW + w]
    out = full[..., 1 : 1 + w] * taps[:, 0, None]
    for j in range(1, KW):
        out = out + full[..., 1 + j : 1 + j + w] * taps[:, j, None]
    if bias is not None:
        out = out + bias.float()[:, None]
    return out.to(weight.dtype)


def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
          dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`g` fp32 (the natural-log decay) and `beta` in b's dtype from `a, b` `[B, T, HV]`, as
    transformers' GDN forward computes them."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def split_heads(x: torch.Tensor, HK: int, K: int, HV: int, V: int):
    """`[B, T, 2 * HK * K + HV * V]` (q | k | v channels) -> `q, k` `[B, T, HK, K]`, `v` `[B, T, HV, V]`."""
    B, T = x.shape[:2]
    q, k, v = torch.split(x, [HK * K, HK * K, HV * V], dim=-1)
    return q.reshape(B, T, HK, K), k.reshape(B, T, HK, K), v.reshape(B, T, HV, V)


def gdn_conv_verify(mixed, window, conv_weight, conv_bias, a, b, A_log, dt_bias, state, *, scale=None,
                    use_qk_l2norm=True, num_tokens=None):
    """Naive twin of `hybridspec.ops.gdn_conv_verify`: conv, SiLU (rounded to the weight's dtype, then
    to `mixed`'s), gates, then `naive.gdn_verify`. Returns `(o, z, k, g_cum)` as that does."""
    HV, K, V = state.shape[1:]
    HK = (mixed.shape[-1] - HV * V) // (2 * K)
    x = F.silu(causal_conv(window, mixed.transpose(1, 2), conv_weight, conv_bias)).to(mixed.dtype)
    q, k, v = split_heads(x.transpose(1, 2), HK, K, HV, V)
    g, beta = gates(a, b, A_log, dt_bias)
    return naive.gdn_verify(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm, num_tokens=num_tokens)
