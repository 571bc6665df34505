"""The round's pluggable parts, as protocols: the accept rule, the position processor, the
calibration recorder. (The drafter's protocols live in `hybridspec.drafter.protocol`, the length
policy's in `hybridspec.policy`.)"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from hybridspec.drafter.protocol import DraftBlock


@runtime_checkable
class AcceptRule(Protocol):
    """`(processed [B, n, V], drafts [B, >= n - 1], num_tokens [B] or None) -> (tokens, accepted)`:
    `tokens[:, :A]` the kept drafts, `tokens[:, A]` the token after them, `accepted` A `[B]`.
    `num_tokens` is the round's w when n is the fixed row count (rows past it are ignored)."""

    def __call__(self, processed: torch.Tensor, drafts: torch.Tensor,
                 num_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        ...


@runtime_checkable
class Top1AcceptRule(Protocol):
    """An accept rule that reads nothing of the scores but each position's argmax (greedy reads
    that; a rule may read less): `accept_top1(best [B, n], drafts, num_tokens)` gives what the rule
    gives for any scores whose argmax is `best`. A round on a plain head may then hand it the fused
    LM head's top-1 instead of the `[B, n, V]` logits."""

    def accept_top1(self, best: torch.Tensor, drafts: torch.Tensor,
                    num_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        ...


@runtime_checkable
class Process(Protocol):
    """Raw fp32 logits `[B, n, V]` of the verified positions -> processed scores, as target-only
    decoding processes each position (`drafts` `[B, D]`: the context a position sees)."""

    def __call__(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        ...


@runtime_checkable
class RoundRecorder(Protocol):
    """Calibration's host hook on the reference loop: `begin()` before drafting, `end(...)` after
    the round's tokens are emitted (`routing`: every sparse MoE layer's expert ids `[B, w, k]`)."""

    def begin(self) -> None:
        ...

    def end(self, block: DraftBlock, w: int, accepted: int, routing: list | None, stopped: bool) -> None:
        ...
