"""`hybridspec::gdn_conv_verify`: the GDN mixer from its pre-conv projection (causal conv, SiLU, gates,
verification) as one custom op, its fake kernel and the validating wrapper.

Same form as `gdn_verify` (hybridspec/ops/gdn.py): the body launches the Triton kernel
(hybridspec/ops/gdn_conv_verify_triton.py) for CUDA tensors, and for CPU tensors under
`TRITON_INTERPRET=1`; otherwise it runs the naive twin (hybridspec/ops/naive_gdn_conv.py).
"""

from __future__ import annotations

import torch

from hybridspec.ops import naive_gdn_conv
from hybridspec.ops.checks import FLOAT_INPUTS, check, check_lengths
from hybridspec.ops.dispatch import TRITON_INTERPRET, count_launch, use_triton
from hybridspec.ops.gdn import (
    MAX_TOKENS,
    VERIFY_CONFIG,
    GDNFactors,
    block_v,
    check_head_dim,
    factor_buffers,
    gdn_precision,
)


@torch.library.custom_op(
    "hybridspec::gdn_conv_verify", mutates_args=("inputs_out", "z_out", "k_out", "g_out"), device_types=None
)
def _gdn_conv_verify_op(
    mixed: torch.Tensor,
    window: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    num_tokens: torch.Tensor | None,
    inputs_out: torch.Tensor,
    z_out: torch.Tensor,
    k_out: torch.Tensor,
    g_out: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    B, T, C = mixed.shape
    HV, K, V = state.shape[1:]
    o = torch.empty(B, T, HV, V, dtype=mixed.dtype, device=mixed.device)
    if use_triton(mixed):
        from hybridspec.ops.gdn_conv_verify_triton import gdn_conv_verify_kernel

        BV = block_v(V, VERIFY_CONFIG)
        gdn_conv_verify_kernel[(V // BV, B * HV)](
            mixed, window, conv_weight, conv_weight if conv_bias is None else conv_bias, a, b, A_log, dt_bias,
            state, mixed if num_tokens is None else num_tokens,
            inputs_out, o, z_out, k_out, g_out,
            T, scale,
            mixed.stride(0), mixed.stride(1),
            window.stride(0), window.stride(1), window.stride(2),
            conv_weight.stride(0), conv_weight.stride(1),
            a.stride(0), a.stride(1),
            b.stride(0), b.stride(1),
            inputs_out.stride(0), inputs_out.stride(1),
            HK=(C - HV * V) // (2 * K), HV=HV, K=K, V=V, KW=window.shape[-1],
            BT=MAX_TOKENS, BV=BV, BK=min(K, VERIFY_CONFIG["BK"]),
            HAS_BIAS=conv_bias is not None, HAS_NUM_TOKENS=num_tokens is not None, USE_L2NORM=use_qk_l2norm,
            PRECISION=gdn_precision(mixed), INTERPRET=TRITON_INTERPRET,
            num_warps=VERIFY_CONFIG["num_warps"],
        )
        count_launch("gdn_conv_verify")
        return o
    o_ref, z, kn, g_cum = naive_gdn_conv.gdn_conv_verify(
        mixed, window, conv_weight, conv_bias, a, b, A_log, dt_bias, state, scale=scale,
        use_qk_l2norm=use_qk_l2norm, num_tokens=num_tokens,
    )
    inputs_out[:, :, :T].copy_(mixed.transpose(1, 2))
    o.copy_(o_ref)
    z_out.copy_(z)
    k_out.copy_(kn)
    g_out.copy_(g_cum)
    return o


@_gdn_conv_verify_op.register_fake
def _(mixed, window, conv_weight, conv_bias, a, b, A_log, dt_bias, state, num_tokens, inputs_out, z_out, k_out,
      g_out, scale, use_qk_l2norm):
    B, T = mixed.shape[:2]
    return mixed.new_empty(B, T, state.shape[1], state.shape[3])


def gdn_conv_verify(
    mixed: torch.Tensor,
    window: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    num_tokens: torch.Tensor | None = None,
    inputs_out: torch.Tensor | None = None,
    factors_out: GDNFactors | None = None,
) -> tuple[torch.Tensor, GDNFactors, torch.Tensor]:
    """The GDN mixer of T <= 16 tokens from its pre-conv projection, in one launch: what the causal
    conv over `window` and `mixed`, the SiLU, `beta = sigmoid(b)`, `g = -exp(A_log) softplus(a + dt_bias)`
    and `gdn_verify` compute (hybridspec/ops/naive_gdn_conv.py), with their roundings.

    `mixed` `[B, T, C]` (channels q | k | v, `C = 2 HK K + HV V`), `window` `[B, C, KW]` (the conv
    window before the round), `conv_weight` `[C, KW]`, `conv_bias` `[C]` or None, `a, b` `[B, T, HV]`,
    `A_log, dt_bias` `[HV]`, `state` `[B, HV, K, V]` fp32 (not modified); HK follows from C. `mixed`,
    `a` and `b` may have any batch and row strides. `num_tokens` `[B]` int: rows at or past it are
    ignored (they may hold NaN). `inputs_out` `[B, C, W >= T]` in mixed's dtype receives `mixed`
    transposed in its first T columns (the round's pre-conv inputs, which the commit rolls into the
    window); `factors_out` as `gdn_verify` takes it. Returns `o` `[B, T, HV, V]` in mixed's dtype,
    the factors and `inputs_out` (new buffers where not given).
    """
    check(mixed.dim() == 3, f"mixed must be [B, T, C], got {tuple(mixed.shape)}")
    B, T, C = mixed.shape
    check(1 <= T <= MAX_TOKENS, f"T must be in 1..{MAX_TOKENS}, got mixed {tuple(mixed.shape)}")
    check(state.dim() == 4 and state.shape[0] == B,
          f"state must be [B, HV, K, V] with B = {B}, got {tuple(state.shape)}")
    check(state.dtype == torch.float32 and state.is_contiguous(), f"state must be contiguous fp32, got {state.dtype}")
    HV, K, V = state.shape[1:]
    check_head_dim("key", K)
    check_head_dim("value", V)
    key_channels = C - HV * V
    check(key_channels > 0 and key_channels % (2 * K) == 0,
          f"mixed's {C} channels must be 2 * HK * {K} (q, k) + {HV} * {V} (v) for some HK >= 1, from state "
          f"{tuple(state.shape)}")
    HK = key_channels // (2 * K)
    check(HV % HK == 0, f"value heads ({HV}) must be a multiple of key heads ({HK}): mixed {tuple(mixed.shape)}, "
                        f"state {tuple(state.shape)}")
    check(window.dim() == 3 and window.shape[:2] == (B, C) and window.shape[2] >= 1,
          f"window must be [B, C, KW] = [{B}, {C}, KW], got {tuple(window.shape)}")
    KW = window.shape[2]
    check(conv_weight.shape == (C, KW), f"conv_weight must be [C, KW] = [{C}, {KW}], got {tuple(conv_weight.shape)}")
    check(conv_bias is None or (conv_bias.shape == (C,) and conv_bias.is_contiguous()),
          f"conv_bias must be contiguous [C] = [{C}], got {None if conv_bias is None else tuple(conv_bias.shape)}")
    for name, t in (("a", a), ("b", b)):
        check(t.shape == (B, T, HV), f"{name} must be [B, T, HV] = [{B}, {T}, {HV}], got {tuple(t.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check(t.shape == (HV,) and t.is_contiguous(), f"{name} must be contiguous [HV] = [{HV}], got {tuple(t.shape)}")
    tensors = {"mixed": mixed, "window": window, "conv_weight": conv_weight, "a": a, "b": b, "A_log": A_log,
               "dt_bias": dt_bias}
    if conv_bias is not None:
        tensors["conv_bias"] = conv_bias
    for name, t in tensors.items():
        check(t.dtype in FLOAT_INPUTS, f"{name} must be fp32, bf16 or fp16, got {t.dtype}")
        check(t.device == mixed.device, f"{name} is on {t.device}, mixed on {mixed.device}")
    for name, t in (("mixed", mixed), ("a", a), ("b", b)):
        check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    check(state.device == mixed.device, f"state is on {state.device}, mixed on {mixed.device}")
    check_lengths("num_tokens", num_tokens, B, mixed.device)
    if inputs_out is None:
        inputs_out = torch.empty(B, C, T, dtype=mixed.dtype, device=mixed.device)
    check(inputs_out.dim() == 3 and inputs_out.shape[:2] == (B, C) and inputs_out.shape[2] >= T
          and inputs_out.stride(-1) == 1,
          f"inputs_out must be [B, C, W] = [{B}, {C}, W >= {T}], contiguous in its last dim, got "
          f"{tuple(inputs_out.shape)} with strides {inputs_out.stride()}")
    check(inputs_out.dtype == mixed.dtype and inputs_out.device == mixed.device,
          f"inputs_out must be {mixed.dtype} on {mixed.device} as mixed, got {inputs_out.dtype} on {inputs_out.device}")
    factors_out = factor_buffers(factors_out, B, T, HK, HV, K, V, mixed.device)
    o = _gdn_conv_verify_op(
        mixed, window, conv_weight, conv_bias, a, b, A_log, dt_bias, state, num_tokens, inputs_out, *factors_out,
        K**-0.5 if scale is None else float(scale), use_qk_l2norm,
    )
    return o, GDNFactors(*factors_out), inputs_out
