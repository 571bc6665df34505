"""`hybridspec::route_topk`: custom op, fake kernel and host wrapper for the MoE router's work
after its GEMM (fp32 softmax, top-k, renormalisation, cast) in one launch.

Same form as the other ops (docs/design.md, "Ops"): the body launches the Triton kernel
(hybridspec/ops/route_triton.py) for CUDA tensors, and for CPU tensors under `TRITON_INTERPRET=1`,
and runs the naive twin (hybridspec/ops/naive_route.py) otherwise. It replaces aten's softmax,
`topk` (gatherTopK + bitonicSort), division and cast: four or more launches per MoE layer.
"""

from __future__ import annotations

import torch

from hybridspec.ops import naive_route
from hybridspec.ops.checks import FLOAT_INPUTS, check, next_pow2
from hybridspec.ops.dispatch import TRITON_INTERPRET, count_launch, pdl_launch, use_pdl, use_triton

# one program holds a whole row: the wrapper refuses wider rows
MAX_EXPERTS = 1024


@torch.library.custom_op("hybridspec::route_topk", mutates_args=(), device_types=None)
def _route_topk_op(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(logits):
        return naive_route.route_topk(logits, k, normalize)
    from hybridspec.ops.route_triton import route_topk_kernel

    R, E = logits.shape
    weights = torch.empty(R, k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(R, k, dtype=torch.long, device=logits.device)
    ep = max(16, next_pow2(E))
    pdl = use_pdl(logits)
    route_topk_kernel[(R,)](
        logits, weights, ids,
        E, k, logits.stride(0),
        EP=ep, KP=max(2, next_pow2(k)), NORMALIZE=normalize,
        INTERPRET_BF16=TRITON_INTERPRET and logits.dtype == torch.bfloat16, USE_PDL=pdl, **pdl_launch(pdl),
        # each of the k selection rounds is a reduction over the row: within one warp it is register
        # shuffles only, no shared-memory round trip and barrier per round
        num_warps=1 if ep <= 512 else 2,
    )
    count_launch("route_topk")
    return weights, ids


@_route_topk_op.register_fake
def _(logits, k, normalize):
    R = logits.shape[0]
    return logits.new_empty(R, k), logits.new_empty(R, k, dtype=torch.long)


def route_topk(logits: torch.Tensor, k: int, *, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router's selection from its logits, as transformers' `Qwen3_5MoeTopKRouter` /
    `Qwen3NextTopKRouter` compute it after `F.linear`: `probs = softmax(logits, dtype=float32)`,
    the `k` largest probabilities, with `normalize` each divided by their fp32 sum, cast to the
    logits' dtype.

    `logits` `[R, E]` (R >= 1, 1 <= k <= E <= 1024, last dim contiguous), fp32, bf16 or fp16.
    Returns `weights` `[R, k]` in the logits' dtype and `ids` `[R, k]` int64, in descending order of
    probability (as `torch.topk(sorted=True)`); among exactly equal probabilities the lowest expert
    index comes first (`torch.topk` leaves that order unspecified). One launch, one program per row.
    The same arithmetic, not the same rounding: the kernel's `exp` and its order of summation may
    differ from torch's softmax in the last bit, as between two softmax implementations.
    """
    check(logits.dim() == 2 and logits.shape[0] >= 1 and logits.shape[1] >= 1,
          f"logits must be [R, E] with R >= 1 and E >= 1, got {tuple(logits.shape)}")
    R, E = logits.shape
    check(logits.dtype in FLOAT_INPUTS, f"logits must be fp32, bf16 or fp16, got {logits.dtype}")
    check(logits.stride(1) == 1 or E == 1,
          f"logits must be contiguous in their last dim, got strides {logits.stride()}")
    check(E <= MAX_EXPERTS, f"logits [R, E] = {tuple(logits.shape)}: at most {MAX_EXPERTS} experts per row")
    check(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= E,
          f"k must be an int with 1 <= k <= E = {E}, got {k!r}")
    return _route_topk_op(logits, k, bool(normalize))
