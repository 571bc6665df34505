"""The static buffers between the host and a captured step, one row per batch row.

Each step writes `out` `[B, T + EXTRA]`: the T tokens of the round (the first m are emitted), then
m, w, w0, the first emitted position whose sampled distribution was empty (T + 1 if none) and the
distinct Layer-0 experts of the verified tokens (-1 where Layer 0 has no router boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

# columns of `out` after the tokens
M, W_COL, W0_COL, EMPTY_COL, L0_COL = range(5)
EXTRA = 5


def write_outputs(anchor: torch.Tensor, budget: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor,
                  accepted: torch.Tensor, w: torch.Tensor, w0: torch.Tensor, empty: torch.Tensor,
                  layer0: torch.Tensor) -> None:
    """`RoundIO.finish` on the buffers."""
    anchor.copy_(tokens.gather(1, accepted[:, None]))
    budget.sub_(accepted + 1)
    width = out.shape[1] - EXTRA
    out.copy_(torch.cat([tokens[:, :width], torch.stack([accepted + 1, w, w0, empty, layer0], dim=-1)], dim=-1))


@dataclass
class RoundIO:
    anchor: torch.Tensor  # [B, 1] long: x_0, the newest token the target has not processed
    budget: torch.Tensor  # [B] long: output tokens still allowed after the anchor
    out: torch.Tensor  # [B, T + EXTRA] long
    # the body of `finish` (`write_outputs`); a compiled runner sets a compiled copy
    # (`hybridspec.cache.compiled_copy`): eagerly it is about eight small kernels
    finish_fn: Callable = field(default=write_outputs, repr=False)

    @classmethod
    def allocate(cls, width: int, device, batch_size: int = 1) -> RoundIO:
        B = batch_size
        return cls(torch.zeros(B, 1, dtype=torch.long, device=device), torch.ones(B, dtype=torch.long, device=device),
                   torch.zeros(B, width + EXTRA, dtype=torch.long, device=device))

    def finish(self, tokens: torch.Tensor, accepted: torch.Tensor, w: torch.Tensor, w0: torch.Tensor,
               empty: torch.Tensor, layer0: torch.Tensor) -> None:
        """After a step: the next anchor, the budget left, and the row the host reads."""
        self.finish_fn(self.anchor, self.budget, self.out, tokens, accepted, w, w0, empty, layer0)
