"""`hybridspec::route_gemm_topk`: the MoE router's GEMM and its top-k in one launch, for a row or two.

At one row the router is `small_linear_partials` (the router's rows with the block's fused rows
after them, split K ways) and then `route_topk_partials`, one program that adds the splits and
selects: the second launch's whole work is one row's reduction, so what it costs is its launch and
the wait for the GEMM's last program. Here the GEMM's programs write the same partials and count
their arrival on a counter in device memory; the program that arrives last (it sees every other
program's partials, by the ticket's release and acquire) routes the rows from them as
`route_topk_partials` does, the same loads and arithmetic, so the same bits, and sets the counter
back to zero. The rows are routed one after another by that one program, so the caller takes this
op only at a few rows (`LinearKernelConfig.router_fused_rows`); a batched round's 16 to 64 rows
keep the two launches, which route the rows in parallel.

The counter is an int32 `[1]` buffer of the caller's (one per MoE block: the block's fused weight
holds it, `hybridspec/fused.py`), zero between launches. Two launches with one counter must not
run at the same time (two streams replaying one model's graphs concurrently): a stream orders its
own launches. Same form as the other ops (docs/design.md, "Ops"); the twin is
`small_linear_partials` then `route_topk_partials`, naive.
"""

from __future__ import annotations

import torch

from hybridspec.ops import naive_linear, naive_route
from hybridspec.ops.checks import check, dot_precision, is_integer, next_pow2
from hybridspec.ops.dispatch import TRITON_INTERPRET, count_launch, pdl_launch, use_pdl, use_triton
from hybridspec.ops.linear import MAX_SPLITS, _check_inputs, plan
from hybridspec.ops.route import MAX_EXPERTS, REST_BLOCK


def _launch(x, weight, splits, experts, k, normalize, counter, weights, ids, rest) -> None:
    from hybridspec.ops.linear import KERNEL_CONFIG
    from hybridspec.ops.route_triton import route_gemm_topk_kernel

    M, K = x.shape
    N = weight.shape[0]
    bm, bn, bk, stages, span = plan(x, weight, splits)
    partials = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    ep = max(16, next_pow2(experts))
    pdl = use_pdl(x)
    route_gemm_topk_kernel[(-(-N // bn), -(-M // bm), splits)](
        x, weight, partials, weights, ids, rest, counter,
        M, N, K, span, experts, x.stride(0), weight.stride(0), max(1, rest.stride(0)),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=dot_precision(x),
        UPCAST=TRITON_INTERPRET and x.dtype != torch.float32, S=splits, EP=ep, TOPK=k, KP=max(2, next_pow2(k)),
        BR=REST_BLOCK, NORMALIZE=normalize, INTERPRET_BF16=TRITON_INTERPRET and x.dtype == torch.bfloat16,
        USE_PDL=pdl, num_warps=KERNEL_CONFIG.num_warps, num_stages=stages, **pdl_launch(pdl),
    )


@torch.library.custom_op("hybridspec::route_gemm_topk", mutates_args=("counter",), device_types=None)
def _route_gemm_topk_op(x: torch.Tensor, weight: torch.Tensor, splits: int, experts: int, k: int, normalize: bool,
                        counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        partials = naive_linear.small_linear_partials(x, weight, splits)
        return naive_route.route_topk_partials(partials, experts, k, normalize, x.dtype)
    M, N = x.shape[0], weight.shape[0]
    weights = torch.empty(M, k, dtype=x.dtype, device=x.device)
    ids = torch.empty(M, k, dtype=torch.long, device=x.device)
    rest = torch.empty(M, N - experts, dtype=x.dtype, device=x.device)
    _launch(x, weight, splits, experts, k, normalize, counter, weights, ids, rest)
    count_launch("route_gemm_topk")
    return weights, ids, rest


@_route_gemm_topk_op.register_fake
def _(x, weight, splits, experts, k, normalize, counter):
    M, N = x.shape[0], weight.shape[0]
    return x.new_empty(M, k), x.new_empty(M, k, dtype=torch.long), x.new_empty(M, N - experts)


def new_counter(device) -> torch.Tensor:
    """A zeroed arrival counter for `route_gemm_topk`."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def route_gemm_topk(x: torch.Tensor, weight: torch.Tensor, splits: int, experts: int, k: int, *, normalize: bool,
                    counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route_topk_partials(small_linear_partials(x, weight, splits), experts, k, normalize=...,
    dtype=x.dtype)` in one launch: `(weights [M, k], ids [M, k], rest [M, N - experts])`.

    `x` `[M, K]` and `weight` `[N, K]` as `small_linear_partials` takes them, the router's
    `experts` rows first; `counter` an int32 `[1]` tensor on x's device holding zero
    (`new_counter`), left at zero.
    """
    _check_inputs(x, weight)
    N = weight.shape[0]
    check(isinstance(splits, int) and 1 <= splits <= MAX_SPLITS, f"splits must be an int in 1..{MAX_SPLITS}, got {splits!r}")
    check(isinstance(experts, int) and not isinstance(experts, bool) and 1 <= experts <= min(N, MAX_EXPERTS),
          f"experts must be an int in 1..min(N, {MAX_EXPERTS}) = 1..{min(N, MAX_EXPERTS)}, got {experts!r}")
    check(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= experts,
          f"k must be an int with 1 <= k <= experts = {experts}, got {k!r}")
    check(counter.shape == (1,) and counter.dtype == torch.int32 and is_integer(counter) and counter.device == x.device,
          f"counter must be an int32 [1] tensor on {x.device}, got {counter.dtype} {tuple(counter.shape)} on {counter.device}")
    return _route_gemm_topk_op(x, weight, splits, experts, k, bool(normalize), counter)
