"""`HybridSpecStats`: per-round statistics of one call, from the runner or the reference loop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def device_time(device: torch.device) -> float:
    """`time.perf_counter()` once `device` has run the work queued on it (a CUDA device is
    synchronised first): the clock the statistics' seconds are read on."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class HybridSpecStats:
    """Per round: `verify_lengths`, `nominal_lengths`, `layer0_experts` (row 0's); `accepted`
    holds each row's drafts kept per round (a batch appends its rows that were still emitting, in
    row order), so `mean_acceptance_length` is per row and round."""

    verify_lengths: list[int] = field(default_factory=list)
    # the policy's nominal choice w0 per round (the routing correction may add one token)
    nominal_lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    # wall time of the rounds (after the prefill and the first token; device synchronised); the
    # runner's includes the rounds launched past the stop
    decode_seconds: float = field(default=0.0, compare=False)
    # time to the first token: wall seconds from the prefill's start until the host holds the first
    # token (device synchronised); transformers' preparation of the call before it is not counted
    prefill_seconds: float = field(default=0.0, compare=False)
    # distinct Layer-0 experts per round (-1: no router boundary)
    layer0_experts: list[int] = field(default_factory=list, compare=False)
    # the runner's host seconds per round outside waiting for the device, the part of it in the
    # graph replay call, and the rounds it launched
    host_seconds: list[float] = field(default_factory=list, compare=False)
    replay_seconds: list[float] = field(default_factory=list, compare=False)
    launched: int = field(default=0, compare=False)
    # per recorded round: the device seconds from the end of the round before (or the decode's
    # start) to its end, and whether it was full: every row verified all w tokens (no row had
    # stopped or had less than w tokens of budget left). Rounds that are not full verify fewer rows
    # (a stopped row counts one, a row near its limit its budget), so they are cheaper than the
    # length's cost; the calibration times full rounds only (`calibration.capture.mean_round_ms`)
    round_seconds: list[float] = field(default_factory=list, compare=False)
    full: list[bool] = field(default_factory=list, compare=False)

    def record(self, w: int, w0: int, kept: list[int], layer0: int, *, seconds: float, full: bool) -> None:
        """One round: its verified and nominal lengths, the drafts kept by each row still emitting
        (in row order), its Layer-0 experts, its device seconds and whether it was full."""
        self.verify_lengths.append(w)
        self.nominal_lengths.append(w0)
        self.accepted.extend(kept)
        self.layer0_experts.append(layer0)
        self.round_seconds.append(seconds)
        self.full.append(full)

    @property
    def rounds(self) -> int:
        return len(self.verify_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens emitted per round, A + 1."""
        return sum(a + 1 for a in self.accepted) / max(1, len(self.accepted))
