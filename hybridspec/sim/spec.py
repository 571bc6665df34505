"""The command-line tools' drafter names: `DIR` (a DFlash checkpoint) or `replay:DIR` (that
drafter's cost with the replay drafter's simulated acceptance), and what a calibration records of
its drafter so that a replay/plain mismatch can be explained."""

from __future__ import annotations

import torch

from hybridspec.fingerprint import fingerprint
from hybridspec.loading import load_drafter
from hybridspec.sim.replay import DeviceReplayDrafter, ReplayDrafter, replay_fingerprint_config

REPLAY_PREFIX = "replay:"


def load_drafter_spec(spec: str, device: str, dtype: torch.dtype | None = None):
    """`DIR` -> `DFlashDrafter`; `replay:DIR` -> `DeviceReplayDrafter` over it (assign
    `.continuation` before each prompt; its draws come from torch's global generator, so seed that)."""
    replay = spec.startswith(REPLAY_PREFIX)
    drafter = load_drafter(spec[len(REPLAY_PREFIX):] if replay else spec, device, dtype)
    return DeviceReplayDrafter(drafter, torch.zeros(0, dtype=torch.long)) if replay else drafter


def is_replay(drafter) -> bool:
    """True for the replay drafters (simulated acceptance)."""
    return isinstance(drafter, (ReplayDrafter, DeviceReplayDrafter))


def drafter_identity(drafter) -> dict:
    """What a calibration summary records about its drafter beyond the fingerprint: `drafter_kind`
    ("replay": simulated acceptance, or "plain") and the fingerprints of the underlying drafter used
    plainly and under the replay drafter."""
    plain = (drafter.drafter if is_replay(drafter) else drafter).fingerprint_config()
    return dict(drafter_kind="replay" if is_replay(drafter) else "plain",
                drafter_fingerprints={"plain": fingerprint(plain), "replay": fingerprint(replay_fingerprint_config(plain))})
