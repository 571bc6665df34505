"""Loading a target and a drafter from local directories, as the command-line tools name them.
(The tools' `replay:DIR` drafters, simulated acceptance, are `hybridspec.sim.spec`'s.)"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from hybridspec.drafter import DFlashDrafter
from hybridspec.patches import family_of



def default_dtype(device: str) -> torch.dtype:
    # bf16 is what the GPU kernels are tuned for; CPU runs (tiny models) stay exact in fp32
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def load_target(path: str | os.PathLike, device: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A supported hybrid target from a local directory, in either layout (`*ForCausalLM` or the
    image-text `*ForConditionalGeneration` of the released checkpoints)."""
    if not Path(path, "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    config = AutoConfig.from_pretrained(path)
    architectures = getattr(config, "architectures", None) or []
    auto = AutoModelForImageTextToText if any("ConditionalGeneration" in a for a in architectures) else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=dtype or default_dtype(device)).to(device).eval()
    family_of(model)
    return model


def load_drafter(path: str | os.PathLike, device: str, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """A `DFlashDrafter` from a local checkpoint directory (z-lab format)."""
    if not Path(path, "config.json").is_file():
        raise FileNotFoundError(f"drafter {os.fspath(path)!r} is not a DFlash checkpoint directory (no config.json)")
    return DFlashDrafter.from_pretrained(path, dtype=dtype or default_dtype(device), device=device)
