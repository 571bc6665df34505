"""`hybridspec::gdn_verify_gated`: the GDN mixer's one-row verify (T = 1, the AR step) with the
mixer's gated RMSNorm applied to its output in the same kernel (gdn_verify_gated_triton.py says
why). The factors are `gdn_verify_packed`'s; the output is what `mod.norm(o, gate)` gives for its
`o`. A thin validating wrapper over a custom op whose body is the kernel or the naive twin.
"""

from __future__ import annotations

import torch

from hybridspec.ops import naive
from hybridspec.ops.checks import FLOAT_INPUTS, check
from hybridspec.ops.dispatch import count_launch, pdl_launch, use_pdl, use_triton
from hybridspec.ops.gdn import VERIFY_CONFIG, GDNFactors, _checked, checked_split, copy_twin, pow2_tile, split_packed


def gated_block_k(K: int, config: dict = VERIFY_CONFIG) -> int:
    """The key rows a program loads a step: `gated_BK` as a power-of-two tile of K (`pow2_tile`)."""
    return pow2_tile(K, config["gated_BK"])


def _round_product(weight: torch.dtype, x: torch.dtype) -> bool:
    """Whether `weight * h` (h in `x`'s dtype) is rounded to a 16-bit dtype, as torch promotes it."""
    return x != torch.float32 and torch.promote_types(weight, x) == x


@torch.library.custom_op(
    "hybridspec::gdn_verify_gated", mutates_args=("z_out", "k_out", "g_out"), device_types=None
)
def _gdn_verify_gated_op(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    num_tokens: torch.Tensor | None,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    z_out: torch.Tensor,
    k_out: torch.Tensor,
    g_out: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    scale: float,
    use_qk_l2norm: bool,
    eps: float,
) -> torch.Tensor:
    q, k, v = split_packed(qkv, num_k_heads, head_k_dim, head_v_dim)
    B, T, HK, K = q.shape
    HV, V = v.shape[2:]
    out = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    if use_triton(q):
        from hybridspec.ops.gdn_verify_gated_triton import gdn_verify_gated_kernel

        pdl = use_pdl(q)
        gdn_verify_gated_kernel[(B * HV,)](
            q, k, v, g, beta, state, num_tokens if num_tokens is not None else q, gate, norm_weight,
            out, z_out, k_out, g_out,
            scale, eps,
            q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
            g.stride(0), beta.stride(0), gate.stride(0), gate.stride(2),
            HK=HK, HV=HV, K=K, V=V, BK=gated_block_k(K),
            HAS_NUM_TOKENS=num_tokens is not None, USE_L2NORM=use_qk_l2norm,
            ROUND_INPUT=v.dtype != torch.float32, ROUND_PRODUCT=_round_product(norm_weight.dtype, v.dtype),
            USE_PDL=pdl, num_warps=VERIFY_CONFIG["gated_num_warps"], **pdl_launch(pdl),
        )
        count_launch("gdn_verify_gated")
        return out
    twin = naive.gdn_verify_gated(q, k, v, g, beta, state, gate, norm_weight, eps, scale=scale,
                                  use_qk_l2norm=use_qk_l2norm, num_tokens=num_tokens)
    return copy_twin((out, z_out, k_out, g_out), twin)


@_gdn_verify_gated_op.register_fake
def _(qkv, g, beta, state, num_tokens, gate, norm_weight, z_out, k_out, g_out, num_k_heads, head_k_dim, head_v_dim,
      scale, use_qk_l2norm, eps):
    B, T, C = qkv.shape
    return qkv.new_empty(B, T, (C - 2 * num_k_heads * head_k_dim) // head_v_dim, head_v_dim)


def gdn_verify_gated(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    num_tokens: torch.Tensor | None = None,
    factors_out: GDNFactors | None = None,
) -> tuple[torch.Tensor, GDNFactors]:
    """`gdn_verify_packed` at T = 1 followed by the GDN mixer's gated RMSNorm over each value head:
    `gate` `[B, 1, HV, V]` (contiguous in its last dim; the mixer's `z`), `norm_weight` `[V]`, `eps`
    (transformers' `RMSNormGated` with its silu gate: `naive.gated_rms_norm`). Returns the normed
    output `[B, 1, HV, V]` in `qkv`'s dtype (zeros for a row past `num_tokens`) and the factors."""
    check(qkv.dim() == 3 and qkv.shape[1] == 1,
          f"gdn_verify_gated takes one row (T = 1) of qkv [B, 1, C], got {tuple(qkv.shape)}")
    q, k, v = checked_split(qkv, num_k_heads, head_k_dim, head_v_dim)
    factors_out = _checked(q, k, v, g, beta, state, num_tokens, factors_out)
    B, _, HV, V = v.shape
    check(gate.shape == (B, 1, HV, V) and gate.stride(-1) == 1,
          f"gate must be [B, 1, HV, V] = [{B}, 1, {HV}, {V}] contiguous in its last dim, got {tuple(gate.shape)} "
          f"strides {gate.stride()}")
    check(norm_weight.shape == (V,) and norm_weight.is_contiguous(),
          f"norm_weight must be a contiguous [{V}], got {tuple(norm_weight.shape)}")
    for name, t in (("gate", gate), ("norm_weight", norm_weight)):
        check(t.dtype in FLOAT_INPUTS and t.device == qkv.device,
              f"{name} must be fp32, bf16 or fp16 on {qkv.device}, got {t.dtype} on {t.device}")
    out = _gdn_verify_gated_op(
        qkv, g, beta, state, num_tokens, gate, norm_weight, *factors_out, num_k_heads, head_k_dim, head_v_dim,
        head_k_dim**-0.5 if scale is None else float(scale), use_qk_l2norm, float(eps),
    )
    return out, GDNFactors(*factors_out)
