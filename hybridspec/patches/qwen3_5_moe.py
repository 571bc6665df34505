"""Qwen3.5 / Qwen3.6 MoE (`Qwen3_5MoeForCausalLM`, `Qwen3_5MoeForConditionalGeneration`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

from hybridspec import parallel
from hybridspec.fused import project
from hybridspec.patches.common import conv_verify, gdn_core
from hybridspec.split_projection import split_in_gemm
from hybridspec.state import GDNSlot

MODEL_TYPES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
# the GDN mixer's input projections, in the order `gdn_verify_layer` splits their fused output
GDN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
apply_rope = modeling.apply_rotary_pos_emb
# the GDN mixer's norm and the forward transformers defines it with, taken at import (before any
# kernelize can swap it): `plain_gated_norm`
GATED_NORM = (modeling.Qwen3_5MoeRMSNormGated, modeling.Qwen3_5MoeRMSNormGated.forward)
# the attention mixer's q/k norm, likewise taken at import: `plain_norm` (`attention_prologue`)
QK_NORM = (modeling.Qwen3_5MoeRMSNorm, modeling.Qwen3_5MoeRMSNorm.forward)
# the sparse MoE block's router: `F.linear(x, weight)`, then softmax, top-k, renormalised
ROUTERS = (modeling.Qwen3_5MoeTopKRouter,)


def router_normalizes(router) -> bool:
    """Qwen3.5/3.6's router always renormalises its top-k probabilities."""
    return True


def text_model(model):
    """The decoder stack: `model.model` (CausalLM) or `model.model.language_model` (the checkpoints' layout)."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def text_config(model):
    return text_model(model).config


def rope(model, hidden: torch.Tensor, positions: torch.Tensor):
    """cos/sin for text positions `[B, w]`: the three M-RoPE sections share the text position."""
    return text_model(model).rotary_emb(hidden, positions[None].expand(3, *positions.shape))


def gdn_verify_layer(mod, x: torch.Tensor, slot: GDNSlot, num_tokens: torch.Tensor | None) -> torch.Tensor:
    """`Qwen3_5MoeGatedDeltaNet.forward` for a verified block, with our ops in place of the cache."""
    B, w, _ = x.shape
    linears = tuple(getattr(mod, name) for name in GDN_PROJECTIONS)
    # one GEMM over the fused weight (hybridspec.fused); sharded, transformers' plan gathers the
    # projections' outputs (one all-gather for the four here), so every rank runs the whole GDN core
    qkv, z, b, a = project(mod, "in", linears, x, gemm=split_in_gemm) or parallel.columns_gathered(linears, x)
    # [B, w, C], contiguous in C for the ops
    mixed = conv_verify(mod, qkv.transpose(1, 2), slot).transpose(1, 2).contiguous()
    z = z.reshape(B, w, -1, mod.head_v_dim)
    beta = b.sigmoid()
    g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    return gdn_core(mod, mixed, g, beta, z, slot, num_tokens, gated_norm=GATED_NORM)
