"""Full-size random-weight models of named shapes, built directly on the GPU in bf16.

`"qwen3.6-35b-a3b"`: the target is `Qwen3_5MoeTextConfig()` defaults (40 layers, 30 GDN + 10
attention, 256 experts top-8, hidden 2048; 35B parameters, 69 GB in bf16); the drafter has the
shape of the real 35B-A3B DFlash drafters (8 Qwen3 layers, hidden 2048, taps [1, 10, 19, 28, 37],
block 16). A default fp32 CPU init would need more memory than the GPU host has, so both are built
under `torch.device(device)` with bf16 as the default dtype, from a seed. Random weights give
timings, not a language: pair the target with a replay drafter for acceptance (simulated).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from hybridspec.drafter import DFlashConfig, DFlashDrafter

SHAPES = ("qwen3.6-35b-a3b",)
DRAFTER_35B = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, rms_norm_eps=1e-6, rope_theta=10_000_000.0, max_position_embeddings=262144, num_target_layers=40,
    block_size=16,
)
TAPS_35B = [1, 10, 19, 28, 37]


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


def build_target(shape: str, device="cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 num_layers: int | None = None):
    """The target of `shape`; `num_layers` keeps only the first layers (their 3 GDN : 1 attention
    pattern and every layer's shape stay), for measurements whose cost grows with depth."""
    _check(shape)
    config = Qwen3_5MoeTextConfig() if num_layers is None else Qwen3_5MoeTextConfig(num_hidden_layers=num_layers)
    with _building(device, dtype, seed):
        return Qwen3_5MoeForCausalLM(config).eval()


def build_drafter(shape: str, device="cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> DFlashDrafter:
    _check(shape)
    vocab = Qwen3_5MoeTextConfig().vocab_size
    raw = dict(DRAFTER_35B, vocab_size=vocab, dflash_config={"target_layer_ids": TAPS_35B, "mask_token_id": vocab - 1})
    with _building(device, dtype, seed):
        return DFlashDrafter(DFlashConfig.from_dict(raw)).eval()
