"""Output projections (and, opt-in, the mixers' input projections) as split-K partial sums that
their consumer adds.

A layer's output projection (a GDN mixer's `out_proj`, an attention mixer's `o_proj`, the
drafter's `o_proj` and MLP `down_proj`) maps a wide input (K = 4096 to 6144 at the 35B-A3B shape)
to the hidden size for a few rows. cuBLAS runs it split-K and adds the splits in a reduce kernel of
its own (1.7 us of the 8.7 us an out projection takes at one row on the H200). Here
`small_linear_partials` writes the splits' fp32 partial sums and the caller adds them: inside a
compiled layer that add, the rounding to the weights' dtype, the residual add and the norm after it
are one inductor kernel, so the split costs no launch.

`LinearKernelConfig.out_split_k` (hybridspec/ops/linear.py) is the number of splits: 4 by default
(the H200's best, docs/benchmarks.md); 1 keeps every projection on its module (`F.linear`). The sum
of the splits is fp32 in a fixed order, rounded once: another summation order than cuBLAS's, the
same function.

`split_in_gemm` does the same for a mixer's fused input projection (GDN `in`, attention `qkv`:
`LinearKernelConfig.in_split_k`, 1 by default, so `F.linear`). cuBLAS tiles the GDN one (12,352 x
2,048 at the 35B-A3B shape) into 97 tiles of 128 rows, fewer than the H200's 132 SMs (16.3 us against
an 11.9 us bound at one row, before coordinate-descent tuning: with it, inductor runs a one-row
`F.linear` as a reduction kernel of its own, `hybridspec.ops.dispatch.LAYER_OPTIONS`); split K ways,
the sum fuses into the conv, gates and norm that read it.
Measured on the H200 (`benchmarks/bench_runner.py --ar-linear "in_split_k=2;in_split_k=4"`, 2026-12-06):
the AR step took 3.233 and 3.420 ms against 3.090 with cuBLAS (one process; two since-removed
experiments were on in every row), so it stays off. A one-row register-tile kernel with a fixed tile
(`row_linear`, 4 features x 1,024 columns, 16 warps) lost to inductor's tuned reduction on an H100
(3.469 against 3.329 ms; docs/ar-step-levers.md) and was removed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridspec.fused import plain_unsharded
from hybridspec.ops import linear as linear_ops
from hybridspec.ops import small_linear_partials
from hybridspec.ops.linear import fits


def summed_partials(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor | None:
    """`x @ weight.T` on `[..., K]` as `splits` split-K partial sums added here in fp32 and rounded
    once to x's dtype; None where `splits` is 1 (off) or `small_linear` would not take the inputs
    (more than 64 rows, no kernel device, an autograd graph)."""
    flat = x.reshape(-1, x.shape[-1])
    if splits <= 1 or not fits(flat, weight):
        return None
    return small_linear_partials(flat, weight, splits).sum(0).to(x.dtype).view(*x.shape[:-1], -1)


def split_out_projection(linear, x: torch.Tensor) -> torch.Tensor | None:
    """`linear(x)` as `KERNEL_CONFIG.out_split_k` summed partials (`summed_partials`); None where
    those are off or not taken, or the linear is not `plain_unsharded` (a bias, hooks, an adapter or
    a sharded weight): the caller then runs the linear as before."""
    if not plain_unsharded(linear):
        return None
    return summed_partials(x, linear.weight, linear_ops.KERNEL_CONFIG.out_split_k)


def split_in_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for a mixer's fused input projection (`project(..., gemm=split_in_gemm)`)
    as `KERNEL_CONFIG.in_split_k` summed partials (`summed_partials`), else `F.linear`."""
    out = summed_partials(x, weight, linear_ops.KERNEL_CONFIG.in_split_k)
    return out if out is not None else F.linear(x, weight)
