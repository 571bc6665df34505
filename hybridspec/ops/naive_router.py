"""The MoE block's first GEMM and the router's selection in plain torch: the oracle for
`router_triton.py` and the op's body on CPU. The two twins composed, as the two ops would run."""

from __future__ import annotations

import torch

from hybridspec.ops import naive_linear, naive_route


def router_topk(x: torch.Tensor, weight: torch.Tensor, num_experts: int, k: int,
                normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logits = x @ weight.T` `[M, N]` (fp32 accumulation, one rounding), and the router's weights
    and ids `[M, k]` from its first `num_experts` columns (`naive_route.route_topk`)."""
    logits = naive_linear.small_linear(x, weight)
    weights, ids = naive_route.route_topk(logits[:, :num_experts], k, normalize)
    return logits, weights, ids
