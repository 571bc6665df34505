"""`hybridspec::router_topk`: custom op, fake kernel and host wrapper for the MoE block's first GEMM
(`x @ weight.T`, the router's rows first) and the router's selection on its first E outputs, in one
launch: `small_linear` and `route_topk` fused, with their bits, for decode and verification rows
(M <= 16).

Same form as the other ops (docs/design.md, "Ops"): the body launches the Triton kernel
(hybridspec/ops/router_triton.py) for CUDA tensors, and for CPU tensors under `TRITON_INTERPRET=1`,
and runs the naive twin (hybridspec/ops/naive_router.py) otherwise.

The kernel's last program is found with an int32 counter, which the caller passes (`new_counter`)
and keeps. Why not the op's own: one allocated per call is a zero-fill launch more, the launch this
op removes; one cached per device would be a process-wide counter shared by every caller, allocated
from a graph's private pool (and never zeroed outside it) when its first call is being captured. A
counter the caller allocates outside any capture (the MoE block holds one per layer:
`patches/common.py: keep_router_counter`) has a fixed address for CUDA graphs, and every launch
leaves it at 0 as it found it. One launch at a time per counter: two streams running the op
concurrently need a counter each.
"""

from __future__ import annotations

import torch

from hybridspec.ops import linear, naive_router
from hybridspec.ops.checks import FLOAT_INPUTS, check, next_pow2
from hybridspec.ops.dispatch import count_launch, use_triton
from hybridspec.ops.route import MAX_EXPERTS

# the GEMM's rows are one tile and the last program routes them all: decode and verification rows
MAX_ROWS = 16
# the last program routes blocks of rows of at most this many lanes (rows x experts padded): all 16
# rows at E = 256, 4 at E = 1024, in registers
ROUTE_LANES = 4096


def new_counter(device: torch.device | str) -> torch.Tensor:
    """A counter for `router_topk` on `device`: int32 `[1]`, zero."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@torch.library.custom_op("hybridspec::router_topk", mutates_args=("counter",), device_types=None)
def _router_topk_op(x: torch.Tensor, weight: torch.Tensor, counter: torch.Tensor, num_experts: int, k: int,
                    normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return naive_router.router_topk(x, weight, num_experts, k, normalize)
    from hybridspec.ops.router_triton import router_topk_kernel

    M, K = x.shape
    N = weight.shape[0]
    n_tiles, launch = linear.tile_launch(x, N)
    logits = torch.empty(M, N, dtype=x.dtype, device=x.device)
    weights = torch.empty(M, k, dtype=x.dtype, device=x.device)
    ids = torch.empty(M, k, dtype=torch.long, device=x.device)
    ep = max(16, next_pow2(num_experts))
    router_topk_kernel[(n_tiles,)](
        x, weight, logits, weights, ids, counter,
        M, N, K, num_experts, k,
        x.stride(0), weight.stride(0),
        RB=min(next_pow2(M), max(1, ROUTE_LANES // ep)), EP=ep, KP=max(2, next_pow2(k)), NORMALIZE=normalize,
        **launch,
    )
    count_launch("router_topk")
    return logits, weights, ids


@_router_topk_op.register_fake
def _(x, weight, counter, num_experts, k, normalize):
    M = x.shape[0]
    return x.new_empty(M, weight.shape[0]), x.new_empty(M, k), x.new_empty(M, k, dtype=torch.long)


def fits(x2d: torch.Tensor, weight: torch.Tensor, num_experts: int) -> bool:
    """Whether `router_topk(x2d, weight, num_experts, ...)` may replace `small_linear` and
    `route_topk` on these inputs: `small_linear` takes them (`linear.fits`: its kernel runs, nothing
    records autograd), at most `MAX_ROWS` rows, and the first `num_experts` of the weight's rows
    are a router `route_topk` takes (at most `MAX_EXPERTS`). Never raises."""
    return (linear.fits(x2d, weight) and x2d.shape[0] <= MAX_ROWS
            and 1 <= num_experts <= min(weight.shape[0], MAX_EXPERTS))


def router_topk(x: torch.Tensor, weight: torch.Tensor, num_experts: int, k: int, counter: torch.Tensor, *,
                normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logits = small_linear(x, weight)` and `route_topk(logits[:, :num_experts], k,
    normalize=normalize)` in one launch, with the same bits: returns `logits` `[M, N]` (all N rows
    of the weight, so the outputs of the linears fused after the router's stay available), and
    `weights` `[M, k]` in x's dtype and `ids` `[M, k]` int64, as `route_topk` orders them.

    `x` `[M, K]` with 1 <= M <= 16; `weight` `[N, K]` whose first `num_experts` rows are the
    router's (1 <= num_experts <= min(N, 1024)), any row stride; both contiguous in their last dim,
    one dtype (fp32, bf16 or fp16), one device; 1 <= k <= num_experts. `counter`: an int32 `[1]`
    tensor on that device holding 0 (`new_counter`), which the launch uses and leaves at 0; one
    launch at a time per counter (a stream's launches are one at a time).
    """
    check(x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] >= 1,
          f"x must be [M, K] with 1 <= M <= {MAX_ROWS} and K >= 1, got {tuple(x.shape)}")
    M, K = x.shape
    check(weight.dim() == 2 and weight.shape[0] >= 1 and weight.shape[1] == K,
          f"weight must be [N, K] = [N, {K}] with N >= 1, got {tuple(weight.shape)}")
    N = weight.shape[0]
    check(x.dtype in FLOAT_INPUTS, f"x must be fp32, bf16 or fp16, got {x.dtype}")
    check(weight.dtype == x.dtype, f"weight ({weight.dtype}) must have x's dtype {x.dtype}")
    check((x.stride(1) == 1 or K == 1) and (weight.stride(1) == 1 or K == 1),
          f"x and weight must be contiguous in their last dim, got strides {x.stride()} and {weight.stride()}")
    check(weight.device == x.device, f"weight is on {weight.device}, x on {x.device}")
    check(isinstance(num_experts, int) and not isinstance(num_experts, bool)
          and 1 <= num_experts <= min(N, MAX_EXPERTS),
          f"num_experts must be an int with 1 <= num_experts <= min(N, {MAX_EXPERTS}) = {min(N, MAX_EXPERTS)} "
          f"for weight {tuple(weight.shape)}, got {num_experts!r}")
    check(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= num_experts,
          f"k must be an int with 1 <= k <= num_experts = {num_experts}, got {k!r}")
    check(counter.dtype == torch.int32 and tuple(counter.shape) == (1,),
          f"counter must be an int32 tensor of shape [1] (new_counter), got {counter.dtype} {tuple(counter.shape)}")
    check(counter.device == x.device, f"counter is on {counter.device}, x on {x.device}")
    return _router_topk_op(x, weight, counter, num_experts, k, bool(normalize))
