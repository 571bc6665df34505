"""Qwen3-Next (`Qwen3NextForCausalLM`): fused q/k/v/z and b/a projections, plain 1-D RoPE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as modeling

from hybridspec import parallel
from hybridspec.fused import project
from hybridspec.patches.common import conv_verify, gdn_core
from hybridspec.split_projection import split_in_gemm
from hybridspec.state import GDNSlot

MODEL_TYPES = ("Qwen3NextForCausalLM",)
# the GDN mixer's input projections, in the order `gdn_verify_layer` splits their fused output
GDN_PROJECTIONS = ("in_proj_qkvz", "in_proj_ba")
apply_rope = modeling.apply_rotary_pos_emb
# the GDN mixer's norm and the forward transformers defines it with, taken at import (before any
# kernelize can swap it): `plain_gated_norm`
GATED_NORM = (modeling.Qwen3NextRMSNormGated, modeling.Qwen3NextRMSNormGated.forward)
# the attention mixer's q/k norm, likewise taken at import: `plain_norm` (`attention_prologue`)
QK_NORM = (modeling.Qwen3NextRMSNorm, modeling.Qwen3NextRMSNorm.forward)
# the sparse MoE block's router: `F.linear(x, weight)`, then softmax, top-k, renormalised per config
ROUTERS = (modeling.Qwen3NextTopKRouter,)


def router_normalizes(router) -> bool:
    """Qwen3-Next's router renormalises its top-k probabilities where the config says so."""
    return bool(router.norm_topk_prob)


def text_model(model):
    return model.model


def text_config(model):
    return model.model.config


def rope(model, hidden: torch.Tensor, positions: torch.Tensor):
    return model.model.rotary_emb(hidden, positions)


def gdn_verify_layer(mod, x: torch.Tensor, slot: GDNSlot, num_tokens: torch.Tensor | None) -> torch.Tensor:
    """`Qwen3NextGatedDeltaNet.forward` for a verified block, with our ops in place of the cache."""
    B, w, _ = x.shape
    # gathered projections (transformers' plan): every rank runs the whole GDN core
    linears = tuple(getattr(mod, name) for name in GDN_PROJECTIONS)
    qkvz, ba = project(mod, "in", linears, x, gemm=split_in_gemm) or parallel.columns_gathered(linears, x)
    q, k, v, z, b, a = mod.fix_query_key_value_ordering(qkvz, ba)
    mixed = torch.cat([t.reshape(B, w, -1) for t in (q, k, v)], dim=-1).transpose(1, 2)
    # [B, w, C], contiguous in C for the ops
    mixed = conv_verify(mod, mixed, slot).transpose(1, 2).contiguous()
    beta = b.sigmoid()
    g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    return gdn_core(mod, mixed, g, beta, z, slot, num_tokens, gated_norm=GATED_NORM)
