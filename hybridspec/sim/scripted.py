"""A scripted replay drafter: the target's own continuation with mistakes placed by a schedule."""

from __future__ import annotations

from typing import Sequence

import torch

from hybridspec.drafter.protocol import DraftBlock


class ScriptedReplayDrafter:
    """Proposes a known continuation with scripted mistakes, so tests reach every acceptance length.

    `continuation`: the target's own greedy tokens after the prompt, `[n]`. `accept_lengths`: per
    round, how many leading draft tokens are right (the next one is made wrong); cycled.
    """

    target_layer_ids: tuple[int, ...] = ()

    def __init__(self, prompt_len: int, continuation: torch.Tensor, accept_lengths: Sequence[int],
                 block_size: int = 16, vocab_size: int | None = None):
        self.prompt_len = prompt_len
        self.continuation = continuation.flatten().tolist()
        self.accept_lengths = list(accept_lengths)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.rounds = 0

    def bind(self, model) -> None:
        if self.vocab_size is None:
            self.vocab_size = model.get_output_embeddings().weight.shape[0]

    def start(self, input_ids, features) -> None:
        self.rounds = 0

    def propose(self, sequence: torch.Tensor) -> DraftBlock:
        D = self.block_size - 1
        # sequence = prompt + emitted tokens; the anchor is the last emitted one
        done = sequence.shape[1] - self.prompt_len
        truth = self.continuation[done : done + D]
        truth += [0] * (D - len(truth))
        right = self.accept_lengths[self.rounds % len(self.accept_lengths)]
        self.rounds += 1
        tokens = list(truth)
        for i in range(right, D):
            # a token different from the truth at every position past the scripted prefix
            tokens[i] = (truth[i] + 1 + i) % self.vocab_size
        t = torch.tensor([tokens], device=sequence.device)
        # confident where right, doubtful where wrong, so adaptive lengths vary with the script
        conf = torch.tensor([[0.9] * right + [0.3] * (D - right)], device=sequence.device)
        return DraftBlock(t, conf, torch.ones_like(conf))

    def observe(self, features, num_commit) -> None:
        pass
