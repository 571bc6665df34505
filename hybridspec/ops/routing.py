"""Routing statistics of a verified block, on the device: how many distinct experts the first j
tokens touch, and how many experts each token adds to the union of the tokens before it.

The length policy's routing correction (docs/design.md, "Routing correction") reads `n_new` from these
counts without a host sync, and calibration tabulates them per round. Plain tensor ops (a one-hot
scatter and a running maximum), so they capture in a CUDA graph and have no Triton twin to test.
"""

from __future__ import annotations

import torch


def distinct_prefix_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`topk_ids` int `[..., T, k]` -> int64 `[..., T]`: entry j - 1 is the number of distinct
    experts among tokens 1..j (over all k choices of each)."""
    if topk_ids.dim() < 2:
        raise ValueError(f"topk_ids must be [..., T, k], got {tuple(topk_ids.shape)}")
    *lead, T, k = topk_ids.shape
    hit = torch.zeros(*lead, T, num_experts, dtype=torch.int8, device=topk_ids.device)
    hit.scatter_(-1, topk_ids.long(), 1)
    # an expert is in the prefix union once any token up to j chose it
    seen = hit.cummax(dim=-2).values
    return seen.sum(-1, dtype=torch.int64)


def new_expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[..., T, k]` -> int64 `[..., T]`: entry j - 1 is the number of experts token j adds to the
    union of tokens 1..j-1 (the first token adds all of its distinct choices)."""
    counts = distinct_prefix_counts(topk_ids, num_experts)
    return counts - torch.nn.functional.pad(counts, (1, 0))[..., :-1]
