"""Loading a target and a drafter from local directories, as the command-line tools name them.

A drafter is named `DIR` (a DFlash checkpoint) or `replay:DIR` (that drafter's cost with the replay
drafter's simulated acceptance, `hybridspec.sim.replay`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from hybridspec.calibration.artifact import fingerprint
from hybridspec.drafter import DFlashDrafter
from hybridspec.patches import family_of

REPLAY_PREFIX = "replay:"


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


def load_drafter(spec: str, device: str, dtype: torch.dtype | None = None):
    """`DIR` -> `DFlashDrafter`; `replay:DIR` -> `DeviceReplayDrafter` over it (assign
    `.continuation` before each prompt; its draws come from torch's global generator, so seed that)."""
    from hybridspec.sim.replay import DeviceReplayDrafter

    replay = spec.startswith(REPLAY_PREFIX)
    path = spec[len(REPLAY_PREFIX):] if replay else spec
    if not Path(path, "config.json").is_file():
        raise FileNotFoundError(f"drafter {spec!r}: {path} is not a DFlash checkpoint directory (no config.json)")
    drafter = DFlashDrafter.from_pretrained(path, dtype=dtype or default_dtype(device), device=device)
    if not replay:
        return drafter
    return DeviceReplayDrafter(drafter, torch.zeros(0, dtype=torch.long))


def is_replay(drafter) -> bool:
    """True for the replay drafters of `hybridspec.sim.replay` (simulated acceptance)."""
    from hybridspec.sim import replay

    return isinstance(drafter, (replay.ReplayDrafter, replay.DeviceReplayDrafter))


def _replay_wrapped(config: dict) -> dict:
    from hybridspec.sim import replay

    return {"replay": {"beta": [replay.BETA_A, replay.BETA_B], "shift": replay.CONFIDENCE_SHIFT,
                       "other_tokens": replay.OTHER_TOKENS},
            "drafter": config}


def drafter_fingerprint_config(drafter) -> dict:
    """The configuration that identifies a drafter for calibration artifacts: the DFlash config,
    and for a replay drafter (host or device draws: the same model) also its fixed acceptance model."""
    if is_replay(drafter):
        return _replay_wrapped(drafter_fingerprint_config(drafter.drafter))
    config = getattr(drafter, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"cannot identify drafter {type(drafter).__name__} for calibration: it has no config")
    return config.to_dict()


def drafter_identity(drafter) -> dict:
    """What a calibration summary records about its drafter beyond the fingerprint, so that a
    mismatch can be explained: `drafter_kind` ("replay": simulated acceptance, or "plain") and the
    fingerprints of the underlying drafter used plain and under the replay drafter."""
    plain = drafter_fingerprint_config(drafter.drafter if is_replay(drafter) else drafter)
    return dict(drafter_kind="replay" if is_replay(drafter) else "plain",
                drafter_fingerprints={"plain": fingerprint(plain), "replay": fingerprint(_replay_wrapped(plain))})


def target_fingerprint(model) -> str:
    """The target's text config, fingerprinted for calibration artifacts."""
    return fingerprint(family_of(model).text_config(model).to_dict())


def drafter_fingerprint(drafter) -> str:
    return fingerprint(drafter_fingerprint_config(drafter))
