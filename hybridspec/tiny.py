"""The embedded default: a seeded tiny Qwen3.5-MoE target and DFlash drafter, no download.

The target keeps the shape of the real models in miniature (3 GDN : 1 attention layers, 2 value
heads per key head, 8 experts, top-2); the drafter is in the z-lab checkpoint format. Both have
random weights: they run every code path, not a language. `tiny_next_target` is the Qwen3-Next
twin of the target. Every head count, the experts and their widths divide by 2, so both targets
also shard over two tensor-parallel ranks (each then holds 16 of every expert's 32 features).
"""

from __future__ import annotations

import copy

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from hybridspec.drafter import DFlashConfig, DFlashDrafter

VOCAB = 128
TARGET = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)
DRAFTER = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
    num_target_layers=4, block_size=16,
    dflash_config={"target_layer_ids": [0, 2, 3], "mask_token_id": VOCAB - 3},
)


def drafter_config(**overrides) -> dict:
    raw = copy.deepcopy(DRAFTER)
    raw.update(overrides)
    return raw


def tiny_target(seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen3_5MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TARGET)).to(dtype).eval()


def tiny_next_target(seed: int = 0, dtype: torch.dtype = torch.float32):
    """The tiny target as a `Qwen3NextForCausalLM` (fused q/k/v/z and b/a projections)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(**{k: v for k, v in TARGET.items() if k != "shared_expert_intermediate_size"},
                             shared_expert_intermediate_size=32, intermediate_size=64)
    return Qwen3NextForCausalLM(config).to(dtype).eval()


def tiny_drafter(raw: dict | None = None, seed: int = 0) -> DFlashDrafter:
    """Weights far from their initialisation, so that drafts differ from position to position:
    sharp attention (large q/k norm gains) and, through the target's small random LM head, peaked
    draft distributions (large final norm gain)."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DFlashConfig.from_dict(raw or DRAFTER))
    gain = {"q_norm": 4.0, "k_norm": 4.0, "norm": 30.0}
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() > 1 or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3)
            else:
                p.copy_((torch.rand_like(p) + 0.5) * gain.get(name.split(".")[-2], 1.0))
    return drafter.eval()
