"""Full-size random-weight models of named shapes, built directly on the GPU in bf16.

`"qwen3.6-35b-a3b"`: the target is `Qwen3_5MoeTextConfig()` defaults (40 layers, 30 GDN + 10
attention, 256 experts top-8, hidden 2048; 35B parameters, 69 GB in bf16); the drafter has the
shape of the real 35B-A3B DFlash drafters (8 Qwen3 layers, hidden 2048, taps [1, 10, 19, 28, 37],
block 16). A default fp32 CPU init would need more memory than the GPU host has, so both are built
under `torch.device(device)` with bf16 as the default dtype, from a seed. Random weights give
timings, not a language: pair the target with a replay drafter for acceptance (simulated).

`"qwen3.5-122b-a10b"`: 48 layers (36 GDN + 12 attention), 256 experts top-8 + a shared expert,
vocabulary 248,320. No public source we could search gives its hidden size, so the shape takes
hidden 3072 with expert width 1024 (256 x 3 x 3072 x 1024 x 48 = 116B expert parameters), 32
attention heads and 2 KV heads of 256, 16 key and 64 value GDN heads of 128, shared expert width
1024: 122.1B parameters, 244 GB in bf16, which fits no single GPU. `build_target(..., mesh=)`
builds it sharded by transformers' tensor-parallel plan, each rank drawing only its shards
(`hybridspec.sharding.build_sharded`). Its drafter takes the 35B drafter's layout at hidden 3072
(taps [1, 12, 23, 34, 45], the 35B drafters' spacing over 48 layers): a guess, as no drafter for
this target is public here. `scale` divides the hidden size and every width (not the head
dimensions or the vocabulary) and `num_layers` cuts the depth, for dry runs on a CPU.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from hybridspec.drafter import DFlashConfig, DFlashDrafter

SHAPES = ("qwen3.6-35b-a3b", "qwen3.5-122b-a10b")
# config overrides of Qwen3_5MoeTextConfig() per shape
TARGETS = {
    "qwen3.6-35b-a3b": {},
    "qwen3.5-122b-a10b": dict(
        hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
    ),
}
# the widths `scale` divides
SCALED = ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size")
DRAFTER_35B = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, rms_norm_eps=1e-6, rope_theta=10_000_000.0, max_position_embeddings=262144, num_target_layers=40,
    block_size=16,
)


@contextlib.contextmanager
def _building(device, dtype: torch.dtype, seed: int):
    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def _check(shape: str) -> None:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def target_config(shape: str, num_layers: int | None = None, scale: int = 1) -> Qwen3_5MoeTextConfig:
    """The target's config: the shape's, its first `num_layers` layers (the 3 GDN : 1 attention
    pattern stays), widths divided by `scale`."""
    _check(shape)
    raw = dict(TARGETS[shape])
    if scale != 1:
        base = Qwen3_5MoeTextConfig()
        raw.update({k: raw.get(k, getattr(base, k)) // scale for k in SCALED})
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
    return Qwen3_5MoeTextConfig(**raw)


def build_target(shape: str, device="cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 num_layers: int | None = None, mesh=None, scale: int = 1):
    """The target of `shape`; `num_layers` keeps only the first layers (their 3 GDN : 1 attention
    pattern and every layer's shape stay), for measurements whose cost grows with depth. With a
    1-D device `mesh`, the target sharded over it by transformers' tensor-parallel plan, each rank
    holding only its shards on `device`."""
    config = target_config(shape, num_layers, scale)
    if mesh is not None:
        from hybridspec.sharding import build_sharded

        return build_sharded(Qwen3_5MoeForCausalLM, config, mesh, device, dtype, seed)
    with _building(device, dtype, seed):
        return Qwen3_5MoeForCausalLM(config).eval()


def drafter_config(shape: str, num_layers: int | None = None, scale: int = 1) -> dict:
    """The raw z-lab-format config of the shape's drafter, for a target of `num_layers` layers."""
    target = target_config(shape, num_layers, scale)
    depth = target.num_hidden_layers
    # the 35B drafters' spacing over this depth: at 40 layers, their taps 1, 10, 19, 28, 37
    taps = sorted({1 + i * ((depth - 4) // 4) for i in range(5)} & set(range(depth)))
    raw = dict(DRAFTER_35B, hidden_size=target.hidden_size, intermediate_size=3 * target.hidden_size,
               num_target_layers=depth, vocab_size=target.vocab_size,
               dflash_config={"target_layer_ids": taps, "mask_token_id": target.vocab_size - 1})
    return raw


def build_drafter(shape: str, device="cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 1,
                  num_layers: int | None = None, scale: int = 1) -> DFlashDrafter:
    """The shape's drafter with random weights, whole on `device` (a drafter is replicated on every
    tensor-parallel rank: build it with the same seed on each)."""
    with _building(device, dtype, seed):
        return DFlashDrafter(DFlashConfig.from_dict(drafter_config(shape, num_layers, scale))).eval()
