"""Stopping on the host from tokens read back lazily: the criteria `generate` builds for a length
limit, EOS ids and `max_time`, evaluated exactly as target-only decoding evaluates them after each
token, without a device tensor per token."""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria


class HostStopping:
    def __init__(self, max_length: int, eos: set[int], timers: list):
        self.max_length, self.eos, self.timers = max_length, eos, timers

    @classmethod
    def from_criteria(cls, criteria, max_length: int) -> HostStopping | None:
        """None when a criterion needs the device sequence (stop strings, custom criteria)."""
        eos, timers = set(), []
        for c in criteria:
            if isinstance(c, MaxLengthCriteria):
                max_length = min(max_length, c.max_length)
            elif isinstance(c, EosTokenCriteria):
                eos.update(torch.as_tensor(c.eos_token_id).flatten().tolist())
            elif isinstance(c, MaxTimeCriteria):
                timers.append(c)
            else:
                return None
        return cls(max_length, eos, timers)

    def __call__(self, length: int, token: int) -> bool:
        """True to stop after appending `token`, which made the sequence `length` long."""
        if length >= self.max_length or token in self.eos:
            return True
        return any(bool(t(torch.zeros(1, length, dtype=torch.long), None).all()) for t in self.timers)
