"""Verification length from the drafter's confidences (DESIGN.md section 2, step 2).

    p_i = prod_{j <= i} c_j,   w0 = argmax_{2 <= w <= W} [1 + sum_{i < w} p_i - rho * C(w)]

ties to the shorter w, capped by the remaining output budget. Every w is scored (the curve may
be nonconvex). Until calibration lands (issue 4) the built-in default takes `c_i` as the raw top-1
confidence and a linear cost curve; the routing correction and two-stage verification also arrive
with issue 4.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LengthPolicy:
    """`cost[w - 1]` = target cost of verifying w tokens, in units of one autoregressive step;
    `rho` = tokens per unit cost that an extra verified token must beat."""

    cost: tuple[float, ...]
    rho: float

    @classmethod
    def builtin_default(cls, max_len: int = 16) -> LengthPolicy:
        # verifying w tokens costs about one AR step plus 3% per extra token (launch-bound small
        # batches); a draft token is worth verifying while its prefix probability exceeds ~0.06
        return cls(cost=tuple(1.0 + 0.03 * (w - 1) for w in range(1, max_len + 1)), rho=2.0)

    def select(self, confidence: torch.Tensor, max_w: int) -> torch.Tensor:
        """`confidence` `[B, D]` -> w0 `[B]` in `2..min(D + 1, max_w)` (or 1 when `max_w` is 1)."""
        B, D = confidence.shape
        top = min(D + 1, max_w, len(self.cost))
        if top <= 1:
            return torch.ones(B, dtype=torch.long, device=confidence.device)
        prefix = torch.cumprod(confidence.float().clamp(0, 1), dim=-1)  # p_1..p_D
        ws = torch.arange(2, top + 1, device=confidence.device)
        # expected tokens of a w-token round: the anchor's token plus p_1 .. p_{w-1}
        gain = 1 + torch.cumsum(prefix, dim=-1)[:, ws - 2]
        cost = torch.tensor(self.cost, device=confidence.device)[ws - 1]
        score = gain - self.rho * cost
        # argmax returns the first maximum: ties go to the shorter length
        return ws[score.argmax(dim=-1)]


_warned = False


def default_policy(max_len: int) -> LengthPolicy:
    global _warned
    if not _warned:
        warnings.warn(
            "hybridspec: no calibration given, using the built-in default length policy (raw drafter "
            "confidence, linear cost). Lengths adapt per round but are not tuned to this model or GPU, and "
            "the routing correction and two-stage verification (which need calibration) are off.",
            stacklevel=3,
        )
        _warned = True
    return LengthPolicy.builtin_default(max_len)
