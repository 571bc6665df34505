"""The MoE router's work after its GEMM, in plain torch: the oracle for `route_triton.py` and the
op's body on CPU. The math of transformers' `Qwen3_5MoeTopKRouter.forward` /
`Qwen3NextTopKRouter.forward` after `F.linear` (fp32 softmax, top-k, optional renormalisation,
cast back to the logits' dtype), with the tie order defined: among equal probabilities the lowest
expert index comes first (`torch.topk` leaves that order unspecified; a stable descending sort
fixes it and agrees with `torch.topk(sorted=True)` wherever the probabilities are distinct).
"""

from __future__ import annotations

import torch


def route_topk(logits: torch.Tensor, k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits` `[R, E]`; returns the weights `[R, k]` in the logits' dtype and the expert ids
    `[R, k]` int64, in descending order of probability, ties to the lowest index. The weights are
    the fp32 softmax probabilities of the chosen experts, with `normalize` each divided by their
    fp32 sum, then cast."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    values, ids = values[:, :k], ids[:, :k]
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype), ids


def route_topk_partials(partials: torch.Tensor, experts: int, k: int, normalize: bool,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`partials` `[S, R, N]` fp32 split-K sums of the router's GEMM (its `experts` columns first);
    their sum in the order s = 0, 1, ..., rounded to `dtype`, routed as `route_topk`; the columns
    past `experts` returned rounded the same way: (weights, ids, rest `[R, N - experts]`)."""
    total = partials[0]
    for s in range(1, partials.shape[0]):
        total = total + partials[s]
    logits = total.to(dtype)
    weights, ids = route_topk(logits[:, :experts], k, normalize)
    return weights, ids, logits[:, experts:].contiguous()
