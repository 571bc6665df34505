"""A few-row linear layer without bias in plain torch: the oracle for `linear_triton.py` and the
op's body on CPU."""

from __future__ import annotations

import torch


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` `[M, K]`, `weight` `[N, K]` in one dtype; returns `x @ weight.T` `[M, N]` in that dtype,
    accumulated in fp32 and rounded once (what `F.linear` computes on the GPU for 16-bit inputs)."""
    return (x.float() @ weight.float().T).to(x.dtype)
