"""`hybridspec::route_topk`: custom op, fake kernel and host wrapper for the MoE router's work
after its GEMM (fp32 softmax, top-k, renormalisation, cast) in one launch.

Same form as the other ops (docs/design.md, "Ops"): the body launches the Triton kernel
(hybridspec/ops/route_triton.py) for CUDA tensors, and for CPU tensors under `TRITON_INTERPRET=1`,
and runs the naive twin (hybridspec/ops/naive_route.py) otherwise. It replaces aten's softmax,
`topk` (gatherTopK + bitonicSort), division and cast: four or more launches per MoE layer.

`hybridspec::route_topk_partials` takes the router GEMM as split-K fp32 partial sums
(`small_linear_partials`) instead of its rounded output and adds them first: the router's GEMM then
runs over 4-8x more programs (272 rows of 2048 at the 35B-A3B shape are only 17 programs of 16 rows
unsplit) at no extra launch for the reduction.
"""

from __future__ import annotations

import torch

from hybridspec.ops import naive_route
from hybridspec.ops.checks import FLOAT_INPUTS, check, next_pow2
from hybridspec.ops.dispatch import TRITON_INTERPRET, count_launch, pdl_launch, use_pdl, use_triton

# one program holds a whole row: the wrapper refuses wider rows
MAX_EXPERTS = 1024
# columns past the experts summed per loop step
REST_BLOCK = 128


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
        E, logits.stride(0),
        EP=ep, K=k, KP=max(2, next_pow2(k)), NORMALIZE=normalize,
        INTERPRET_BF16=TRITON_INTERPRET and logits.dtype == torch.bfloat16, USE_PDL=pdl, **pdl_launch(pdl),
        # each of the k selection rounds is a reduction over the row: within one warp it needs no
        # shared-memory round trip and barrier per round (on sm90 two redux.sync instructions)
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


@torch.library.custom_op("hybridspec::route_topk_partials", mutates_args=(), device_types=None)
def _route_topk_partials_op(partials: torch.Tensor, experts: int, k: int, normalize: bool,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(partials):
        return naive_route.route_topk_partials(partials, experts, k, normalize, dtype)
    from hybridspec.ops.route_triton import route_topk_partials_kernel

    S, R, N = partials.shape
    weights = torch.empty(R, k, dtype=dtype, device=partials.device)
    ids = torch.empty(R, k, dtype=torch.long, device=partials.device)
    rest = torch.empty(R, N - experts, dtype=dtype, device=partials.device)
    ep = max(16, next_pow2(experts))
    pdl = use_pdl(partials)
    route_topk_partials_kernel[(R,)](
        partials, weights, ids, rest,
        experts, N, partials.stride(0), partials.stride(1), max(1, rest.stride(0)),
        S=S, EP=ep, K=k, KP=max(2, next_pow2(k)), BR=REST_BLOCK, NORMALIZE=normalize,
        INTERPRET_BF16=TRITON_INTERPRET and dtype == torch.bfloat16, USE_PDL=pdl, **pdl_launch(pdl),
        num_warps=1 if ep <= 512 else 2,
    )
    count_launch("route_topk_partials")
    return weights, ids, rest


@_route_topk_partials_op.register_fake
def _(partials, experts, k, normalize, dtype):
    R, N = partials.shape[1:]
    return (partials.new_empty(R, k, dtype=dtype), partials.new_empty(R, k, dtype=torch.long),
            partials.new_empty(R, N - experts, dtype=dtype))


def route_topk_partials(partials: torch.Tensor, experts: int, k: int, *, normalize: bool = True,
                        dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route_topk` on router logits given as split-K partial sums: `partials` `[S, R, N]` fp32
    (`small_linear_partials` over the router's rows and, after them, any other rows fused with it),
    the first `experts` columns the router's. Each row's logits are the sum over s = 0, 1, ... in
    that order, in fp32, rounded to `dtype` (the GEMM's output dtype); then as `route_topk`.
    Returns `weights` `[R, k]` in `dtype`, `ids` `[R, k]` int64, and `rest` `[R, N - experts]`: the
    other columns summed and rounded the same way. One launch, one program per row.
    """
    check(partials.dim() == 3 and min(partials.shape) >= 1,
          f"partials must be [S, R, N] with S, R, N >= 1, got {tuple(partials.shape)}")
    check(partials.dtype == torch.float32, f"partials must be fp32, got {partials.dtype}")
    check(partials.stride(2) == 1, f"partials must be contiguous in their last dim, got strides {partials.stride()}")
    N = partials.shape[2]
    check(isinstance(experts, int) and not isinstance(experts, bool) and 1 <= experts <= min(N, MAX_EXPERTS),
          f"experts must be an int in 1..min(N, {MAX_EXPERTS}) = 1..{min(N, MAX_EXPERTS)}, got {experts!r}")
    check(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= experts,
          f"k must be an int with 1 <= k <= experts = {experts}, got {k!r}")
    check(dtype in FLOAT_INPUTS, f"dtype must be fp32, bf16 or fp16, got {dtype}")
    return _route_topk_partials_op(partials, experts, k, bool(normalize), dtype)
