"""`hybridspec::gdn_conv_verify`: the GDN joint producer. The mixer's causal conv, SiLU and gates
folded into the verify kernel (hybridspec/ops/gdn_verify_triton.py with PRODUCER), so a GDN layer
goes from its input projection to the verified outputs in one launch.

Each program recomputes the conv of the channels it reads (its key head's q and k, its value
columns) from the round's pre-conv inputs and the layer's conv window: a key head's conv runs once
per value column tile and value head that read it, 4 x 2 times at the 35B-A3B shape, on data that
is in L1/L2; what it saves is the inductor kernels that wrote the activated q, k, v and the gates
to memory between the projection and the verify kernel, and their launches.

Same op form as `gdn_verify` (docs/design.md, "Ops"): the Triton kernel for CUDA tensors and for
CPU tensors under `TRITON_INTERPRET=1`, the naive twin (hybridspec/ops/naive_gdn_producer.py)
otherwise. The wrapper validates; the kernel trusts its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.ops import naive_gdn_producer
from hybridspec.ops.checks import FLOAT_INPUTS, check, check_lengths
from hybridspec.ops.dispatch import TRITON_INTERPRET, count_launch, pdl_launch, use_pdl, use_triton
from hybridspec.ops.gdn import MAX_TOKENS, VERIFY_CONFIG, GDNFactors, _block_v, _check_head_dim, _precision


@dataclass
class GDNKernelConfig:
    """Which form the verification forward gives a GDN mixer; `benchmarks/bench_runner.py --ar-gdn`
    times the AR step under other values."""

    # the conv, SiLU and gates inside the verify kernel (`gdn_conv_verify`) where the mixer allows it
    # (`hybridspec.patches.common.gdn_producer`); 0: inductor's kernels around `gdn_verify`
    fuse_producer: bool = True


KERNEL_CONFIG = GDNKernelConfig()


@torch.library.custom_op(
    "hybridspec::gdn_conv_verify", mutates_args=("z_out", "k_out", "g_out", "inputs_out"), device_types=None
)
def _gdn_conv_verify_op(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    window: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    num_tokens: torch.Tensor | None,
    z_out: torch.Tensor,
    k_out: torch.Tensor,
    g_out: torch.Tensor,
    inputs_out: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    B, T, HV, V = z_out.shape
    HK, K = k_out.shape[2:]
    o = torch.empty(B, T, HV, V, dtype=mixed.dtype, device=mixed.device)
    if use_triton(mixed):
        from hybridspec.ops.gdn_verify_triton import gdn_verify_kernel

        BV = _block_v(V, VERIFY_CONFIG)
        pdl = use_pdl(mixed)
        gdn_verify_kernel[(V // BV, B * HV)](
            mixed, mixed, mixed, a, b, state, num_tokens if num_tokens is not None else mixed,
            o, z_out, k_out, g_out,
            window, conv_weight, conv_bias if conv_bias is not None else conv_weight, A_log, dt_bias, inputs_out,
            T, scale,
            mixed.stride(0), mixed.stride(1), K,
            0, 0, 0,
            0, 0, 0,
            a.stride(0), a.stride(1),
            b.stride(0), b.stride(1),
            window.stride(0), window.stride(1), inputs_out.stride(0), inputs_out.stride(1),
            HK=HK, HV=HV, K=K, V=V, BT=MAX_TOKENS, BV=BV, BK=min(K, VERIFY_CONFIG["BK"]),
            HAS_NUM_TOKENS=num_tokens is not None, USE_L2NORM=use_qk_l2norm, PRECISION=_precision(mixed),
            USE_PDL=pdl, PRODUCER=True, KW=conv_weight.shape[-1], HAS_BIAS=conv_bias is not None,
            INTERPRET_BF16=TRITON_INTERPRET and mixed.dtype == torch.bfloat16,
            num_warps=VERIFY_CONFIG["num_warps"], **pdl_launch(pdl),
        )
        count_launch("gdn_conv_verify")
        return o
    o_ref, z, kn, g_cum = naive_gdn_producer.gdn_conv_verify(
        mixed, a, b, window, conv_weight, conv_bias, A_log, dt_bias, state, (HK, K, HV, V),
        scale=scale, use_qk_l2norm=use_qk_l2norm, num_tokens=num_tokens,
    )
    o.copy_(o_ref)
    z_out.copy_(z)
    k_out.copy_(kn)
    g_out.copy_(g_cum)
    inputs_out[:, :, :T] = mixed.transpose(1, 2)
    return o


@_gdn_conv_verify_op.register_fake
def _(mixed, a, b, window, conv_weight, conv_bias, A_log, dt_bias, state, num_tokens, z_out, k_out, g_out,
      inputs_out, scale, use_qk_l2norm):
    B, T, HV, V = z_out.shape
    return mixed.new_empty(B, T, HV, V)


def gdn_conv_verify(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    window: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    *,
    key_heads: int,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    num_tokens: torch.Tensor | None = None,
    factors_out: GDNFactors,
    inputs_out: torch.Tensor,
) -> tuple[torch.Tensor, GDNFactors]:
    """`gdn_verify` of the activated causal conv of T <= 16 rounds' inputs, with the gates computed
    from their projections: what `conv_verify`, the gates and `gdn_verify` give, in one launch.

    `mixed` `[B, T, C]` the pre-conv inputs, channels q (`key_heads * Kd`), k (the same), v
    (`HV * Vd`), contiguous in C (rows may be strided: a view of the fused projection's output);
    `a, b` `[B, T, HV]` the raw gate projections (contiguous in HV); `window` `[B, C, KW]` the last
    KW inputs before the round; `conv_weight` `[C, KW]` contiguous and `conv_bias` `[C]` or None,
    in mixed's dtype (the conv's output and the SiLU are rounded to it); `A_log`, `dt_bias` `[HV]`;
    `state` `[B, HV, Kd, Vd]` fp32 (not modified). `factors_out` (its shapes give Kd, HV, Vd) and
    `inputs_out` `[B, C, W]` (W >= T; columns 0..T-1 receive the raw inputs, which the commit
    reads) are written. `num_tokens` as for `gdn_verify`. Returns `o` `[B, T, HV, Vd]` in mixed's
    dtype and the factors."""
    check(mixed.dim() == 3, f"mixed must be [B, T, C], got {tuple(mixed.shape)}")
    B, T, C = mixed.shape
    check(1 <= T <= MAX_TOKENS, f"T must be in 1..{MAX_TOKENS}, got mixed {tuple(mixed.shape)}")
    z, k, g_cum = factors_out
    check(z.dim() == 4 and z.shape[:2] == (B, T), f"factors_out.z must be [B, T, HV, V] = [{B}, {T}, HV, V], got {tuple(z.shape)}")
    HV, V = z.shape[2:]
    check(k.dim() == 4 and k.shape[:3] == (B, T, key_heads),
          f"factors_out.k must be [B, T, HK, K] = [{B}, {T}, {key_heads}, K], got {tuple(k.shape)}")
    HK, K = key_heads, k.shape[3]
    check(HK >= 1 and HV % HK == 0, f"value heads ({HV}) must be a multiple of key heads ({HK})")
    _check_head_dim("key", K)
    _check_head_dim("value", V)
    check(C == 2 * HK * K + HV * V, f"mixed has {C} channels; q, k and v of {HK} key heads of {K} and {HV} value "
          f"heads of {V} are {2 * HK * K + HV * V}")
    check(mixed.dtype in FLOAT_INPUTS and mixed.stride(-1) == 1,
          f"mixed must be fp32, bf16 or fp16 and contiguous in its last dim, got {mixed.dtype} strides {mixed.stride()}")
    for name, t, shape in (("z", z, (B, T, HV, V)), ("k", k, (B, T, HK, K)), ("g_cum", g_cum, (B, T, HV))):
        check(t.shape == shape and t.dtype == torch.float32 and t.is_contiguous() and t.device == mixed.device,
              f"factors_out.{name} must be contiguous fp32 {list(shape)} on {mixed.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    for name, t in (("a", a), ("b", b)):
        check(t.shape == (B, T, HV) and t.stride(-1) == 1 and t.dtype in FLOAT_INPUTS,
              f"{name} must be [B, T, HV] = [{B}, {T}, {HV}] floats, contiguous in HV, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    check(window.dim() == 3 and window.shape[:2] == (B, C) and window.stride(-1) == 1 and window.dtype == mixed.dtype,
          f"window must be [B, C, KW] = [{B}, {C}, KW] in {mixed.dtype}, contiguous in KW, got {window.dtype} {tuple(window.shape)}")
    KW = window.shape[2]
    check(conv_weight.shape == (C, KW) and conv_weight.is_contiguous() and conv_weight.dtype == mixed.dtype,
          f"conv_weight must be contiguous [C, KW] = [{C}, {KW}] in {mixed.dtype}, got {conv_weight.dtype} {tuple(conv_weight.shape)}")
    check(conv_bias is None or (conv_bias.shape == (C,) and conv_bias.is_contiguous()),
          f"conv_bias must be a contiguous [{C}], got {None if conv_bias is None else tuple(conv_bias.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check(t.shape == (HV,) and t.is_contiguous(), f"{name} must be a contiguous [{HV}], got {tuple(t.shape)}")
    check(state.shape == (B, HV, K, V) and state.dtype == torch.float32 and state.is_contiguous(),
          f"state must be contiguous fp32 [B, HV, K, V] = [{B}, {HV}, {K}, {V}], got {state.dtype} {tuple(state.shape)}")
    check(inputs_out.dim() == 3 and inputs_out.shape[:2] == (B, C) and inputs_out.shape[2] >= T
          and inputs_out.stride(-1) == 1 and inputs_out.dtype == mixed.dtype,
          f"inputs_out must be [B, C, W] = [{B}, {C}, >= {T}] in {mixed.dtype}, contiguous in W, got {inputs_out.dtype} {tuple(inputs_out.shape)}")
    for name, t in (("a", a), ("b", b), ("window", window), ("conv_weight", conv_weight), ("A_log", A_log),
                    ("dt_bias", dt_bias), ("state", state), ("inputs_out", inputs_out)):
        check(t.device == mixed.device, f"{name} is on {t.device}, mixed on {mixed.device}")
    if conv_bias is not None:
        check(conv_bias.device == mixed.device, f"conv_bias is on {conv_bias.device}, mixed on {mixed.device}")
    check_lengths("num_tokens", num_tokens, B, mixed.device)
    o = _gdn_conv_verify_op(mixed, a, b, window, conv_weight, conv_bias, A_log, dt_bias, state, num_tokens,
                            z, k, g_cum, inputs_out, K**-0.5 if scale is None else float(scale), use_qk_l2norm)
    return o, GDNFactors(z, k, g_cum)
