"""Recorded acceptance traces (issue 17, part 4): each round's drafter confidence and entropy per
position and how many drafts the target accepted with all of them verified, recorded from a real
target + drafter pair and replayed round after round, in recorded order, by `DeviceReplayDrafter`
instead of the synthetic Beta model. Figures made with them are still simulated acceptance (the
tokens are a replayed continuation), but their confidence and acceptance are a real drafter's.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from hybridspec.sim.replay import ReplayRound

FORMAT = "hybridspec-acceptance-trace/1"


@dataclass
class Trace:
    """`confidence`, `entropy` `[R, D]` float32; `accepted` `[R]` long, drafts the target kept."""

    confidence: torch.Tensor
    entropy: torch.Tensor
    accepted: torch.Tensor
    source: str

    def __post_init__(self):
        R, D = self.confidence.shape
        if R == 0 or self.entropy.shape != (R, D) or self.accepted.shape != (R,):
            raise ValueError(f"a trace needs rounds: confidence {tuple(self.confidence.shape)}, entropy "
                             f"{tuple(self.entropy.shape)}, accepted {tuple(self.accepted.shape)}")
        if not bool(((self.accepted >= 0) & (self.accepted <= D)).all()):
            raise ValueError(f"accepted drafts must be in 0..{D}")

    @property
    def digest(self) -> str:
        data = torch.cat([self.confidence.flatten(), self.entropy.flatten(), self.accepted.float()])
        return hashlib.sha256(data.numpy().tobytes()).hexdigest()

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            # the recorded rounds are a real pair's; a bench replaying them labels its rows simulated
            json.dump({"format": FORMAT, "source": self.source, "acceptance": "real (recorded from the source pair)",
                       "confidence": self.confidence.tolist(),
                       "entropy": self.entropy.tolist(), "accepted": self.accepted.tolist()}, f)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        with open(path) as f:
            d = json.load(f)
        if d.get("format") != FORMAT:
            raise ValueError(f"{os.fspath(path)} is not an acceptance trace ({FORMAT}); record one with "
                             "scripts/record_traces.py")
        return cls(torch.tensor(d["confidence"], dtype=torch.float32), torch.tensor(d["entropy"], dtype=torch.float32),
                   torch.tensor(d["accepted"], dtype=torch.long), d["source"])


class TraceRecorder:
    """A `RoundRecorder`: keeps the rounds that verified all `block_size` tokens and did not stop,
    the only ones whose accepted count is the drafter's full acceptance."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.confidence, self.entropy, self.accepted = [], [], []

    def begin(self) -> None:
        pass

    def end(self, block, w: int, accepted: int, routing, stopped: bool) -> None:
        if w == self.block_size and not stopped:
            self.confidence.append(block.confidence[0].float().cpu())
            self.entropy.append(block.entropy[0].float().cpu())
            self.accepted.append(accepted)

    def trace(self, source: str) -> Trace:
        if not self.accepted:
            raise ValueError("no full verification round was recorded: raise max_new_tokens")
        return Trace(torch.stack(self.confidence), torch.stack(self.entropy), torch.tensor(self.accepted), source)


def record_trace(model, drafter, prompts, max_new_tokens: int, source: str) -> Trace:
    """Greedy speculative decoding of every prompt (`[1, n]` token ids) verifying all drafts each
    round (`verify_length` = block size), recorded. `model` must be `hybridspec.enable`d."""
    recorder = TraceRecorder(drafter.block_size)
    for ids in tqdm(prompts, desc="recording rounds"):
        model.generate(ids, assistant_model=drafter, hybridspec=True, verify_length=drafter.block_size,
                       max_new_tokens=max_new_tokens, do_sample=False, hybridspec_recorder=recorder)
    return recorder.trace(source)


class TraceAcceptance:
    """The draws of `DeviceReplayDrafter(acceptance=...)`: round r replays trace round r mod R, on
    the device (a counter in a static buffer, so a captured round advances it too). Drafts before
    the recorded accepted count are the truth, the rest wrong (truth + 1), never past `known`."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self._device = None
        self._next = None  # [1] long: the next trace round

    def prepare(self, device) -> None:
        device = torch.device(device)
        if self._device != device:
            self._device = device
            self._confidence = self.trace.confidence.to(device)
            self._entropy = self.trace.entropy.to(device)
            self._accepted = self.trace.accepted.to(device)
            self._next = torch.zeros(1, dtype=torch.long, device=device)

    def static_buffers(self) -> list[torch.Tensor]:
        return [self._confidence, self._entropy, self._accepted, self._next]

    def fingerprint_config(self) -> dict:
        return {"trace": self.trace.source, "rounds": int(self.trace.accepted.shape[0]), "sha256": self.trace.digest}

    def draw(self, truth: torch.Tensor, known: torch.Tensor, vocab_size: int) -> ReplayRound:
        """Round r's draws (after `prepare`, which the replay drafter's reset calls)."""
        B, D = truth.shape
        R, Dt = self._confidence.shape
        if Dt < D:
            raise ValueError(f"the trace has {Dt} drafts per round, the drafter {D}")
        r = self._next % R  # [1]
        confidence = self._confidence[r, :D].expand(B, D)
        entropy = self._entropy[r, :D].expand(B, D)
        correct = (torch.arange(D, device=truth.device) < self._accepted[r][:, None]) & known
        tokens = torch.where(correct, truth, (truth + 1) % vocab_size)
        self._next += 1
        return ReplayRound(tokens, confidence, entropy, correct)
