"""Forced acceptance: a benchmark-only accept rule for random-weight targets.

A random-weight target in bf16 does not reproduce its own greedy continuation under another block
split (its logits and routing are near-tied everywhere), so with the target's own acceptance the
replay drafter's acceptance profile collapses to about one token per round. `ForcedAcceptance`
replaces the accept stage: the round keeps as many drafts as the replay draws made correct (at most
w - 1 of the w verified tokens) and emits the continuation itself. The target still verifies every
drafted token, so the work and its routing are real; the tokens are not the target's, so no
exactness holds, and every figure made with it is simulated acceptance.

The decoding path never knows about it: it is an `AcceptRule` handed to `generate` through
`hybridspec_accept=` (bench and tests only), called where the greedy or sampling rule would be.
"""

from __future__ import annotations

import torch

from hybridspec.sim.replay import DeviceReplayDrafter


class ForcedAcceptance:
    """An `AcceptRule` (`hybridspec.round.protocols`) reading the last round of `replay`."""

    simulated = True

    def __init__(self, replay: DeviceReplayDrafter):
        if not isinstance(replay, DeviceReplayDrafter):
            raise TypeError(f"forced acceptance replays a DeviceReplayDrafter's draws, got {type(replay).__name__}")
        self.replay = replay

    def __call__(self, processed: torch.Tensor, draft: torch.Tensor,
                 num_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(tokens [B, D + 1], accepted [B])`: the continuation from the anchor's successor, and
        the draws' leading correct drafts capped at w - 1 (`num_tokens` = w, or all scored rows)."""
        return self._forced(processed.shape[1], num_tokens)

    def accept_top1(self, best: torch.Tensor, draft: torch.Tensor,
                    num_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same from the fused head's argmax `best` `[B, n]` (a `Top1AcceptRule`): the rule
        reads no score, so a round on a plain head skips the logits, as a plain greedy round does."""
        return self._forced(best.shape[1], num_tokens)

    def _forced(self, rows: int, num_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        truth, correct = self.replay.truth, self.replay.correct_prefix
        if truth is None:
            raise RuntimeError("ForcedAcceptance runs after the replay drafter's propose of the same round")
        w = rows if num_tokens is None else num_tokens
        cap = torch.as_tensor(w, device=correct.device) - 1
        return truth, torch.minimum(correct, cap)
