"""Custom ops of hybridspec (namespace `hybridspec::`), each with a naive pure-torch twin."""

from hybridspec.ops.attention import decode_attention
from hybridspec.ops.gdn import GDNFactors, gdn_commit, gdn_verify, gdn_verify_packed, stack_factors
from hybridspec.ops.gdn_gated import gdn_verify_gated
from hybridspec.ops.linear import small_linear, small_linear_partials
from hybridspec.ops.lm_head import lm_head_top1
from hybridspec.ops.moe import moe_experts
from hybridspec.ops.prologue import attention_prologue
from hybridspec.ops.moe_partials import moe_combine, moe_experts_partials
from hybridspec.ops.route import route_topk, route_topk_partials

__all__ = ["GDNFactors", "attention_prologue", "decode_attention", "gdn_commit", "gdn_verify", "gdn_verify_gated", "gdn_verify_packed", "lm_head_top1", "moe_combine", "moe_experts", "moe_experts_partials", "route_topk", "route_topk_partials", "small_linear", "small_linear_partials", "stack_factors"]
