"""A few-row linear layer without bias in plain torch: the oracle for `linear_triton.py` and the
ops' bodies on CPU."""

from __future__ import annotations

import torch


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` `[M, K]`, `weight` `[N, K]` in one dtype; returns `x @ weight.T` `[M, N]` in that dtype,
    accumulated in fp32 and rounded once (what `F.linear` computes on the GPU for 16-bit inputs)."""
    return (x.float() @ weight.float().T).to(x.dtype)


def split_span(K: int, splits: int) -> int:
    """Columns of K per split in `small_linear_partials`: `ceil(K / splits)` rounded up to a
    multiple of 16, so the kernel's K step (a power of two >= 16 dividing it) never crosses a split;
    the last splits may be short or empty."""
    per_split = -(-K // splits)
    return -(-per_split // 16) * 16


def small_linear_partials(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """`[splits, M, N]` fp32: split s holds `x[:, c] @ weight[:, c].T` over its columns
    `c = [s * span, (s + 1) * span)` of K (`split_span`), accumulated in fp32, not rounded; their
    sum over the first dim is `x @ weight.T` before its rounding."""
    span = split_span(x.shape[1], splits)
    parts = [x[:, s * span:(s + 1) * span].float() @ weight[:, s * span:(s + 1) * span].float().T
             for s in range(splits)]
    return torch.stack(parts)
