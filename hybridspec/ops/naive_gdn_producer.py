"""Naive twin of `hybridspec::gdn_conv_verify` (the GDN joint producer): the mixer's causal conv
with its activation, the gates and the verify, as the unfused verification forward computes them
(`hybridspec.patches.common.conv_verify` calls `causal_conv` here, so both paths share one
definition)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridspec.ops import naive


def causal_conv(window: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv of the round's inputs `[B, C, w]` after the window `[B, C, K]` (the
    last K inputs before the round), weight `[C, K]`: output t reads columns t + 1 .. t + K of the
    concatenation, as transformers' single-step update does. The K shifted products are summed in
    fp32 in tap order and rounded once to the weight's dtype, as a 16-bit conv1d rounds its fp32
    accumulator; returns `[B, C, w]` in the weight's dtype, before the activation."""
    w = inputs.shape[-1]
    K = weight.shape[-1]
    full = torch.cat([window, inputs], dim=-1).float()  # [B, C, K + w]
    wf = weight.float()
    out = full[..., 1 : 1 + w] * wf[:, 0, None]
    for j in range(1, K):
        out = out + full[..., 1 + j : 1 + j + w] * wf[:, j, None]
    if bias is not None:
        out = out + bias.float()[:, None]
    return out.to(weight.dtype)


def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """`(g, beta)` `[B, T, HV]` from the raw gate projections: `g = -exp(A_log) * softplus(a +
    dt_bias)` in fp32, `beta = sigmoid(b)` in b's dtype (transformers' GatedDeltaNet forward)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def gdn_conv_verify(mixed, a, b, window, conv_weight, conv_bias, A_log, dt_bias, state, heads, *,
                    scale=None, use_qk_l2norm=True, num_tokens=None):
    """`mixed` `[B, T, C]` pre-conv inputs (q, k, v channels), `window` `[B, C, K]`, `a, b`
    `[B, T, HV]`; `heads` `(HK, Kd, HV, Vd)`. Returns `naive.gdn_verify`'s `(o, z, k, g_cum)` on
    the activated conv outputs and the gates."""
    HK, Kd, HV, Vd = heads
    B, T, _ = mixed.shape
    conv = causal_conv(window, mixed.transpose(1, 2), conv_weight, conv_bias)
    x = F.silu(conv).to(mixed.dtype).transpose(1, 2)  # [B, T, C]
    q, k, v = torch.split(x, [HK * Kd, HK * Kd, HV * Vd], dim=-1)
    g, beta = gates(a, b, A_log, dt_bias)
    return naive.gdn_verify(q.reshape(B, T, HK, Kd), k.reshape(B, T, HK, Kd), v.reshape(B, T, HV, Vd), g, beta,
                            state, scale=scale, use_qk_l2norm=use_qk_l2norm, num_tokens=num_tokens)
