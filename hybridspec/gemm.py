"""Which GEMM a decode step's projection runs on.

A decode step multiplies 1 to 64 rows by each weight. For weights of few output features (the MoE
router with the shared expert's projections, 1,296 rows at the 35B-A3B shape; the shared expert's
down projection and the out projections, 2,048), cuBLAS picks kernels whose grid is a few dozen
tiles on a 132-SM H200 and streams the weight at a fraction of the bandwidth (8.8 us for 5 MB,
docs/benchmarks.md). `hybridspec.ops.small_linear` runs one program per 16 output features, so the
whole chip reads the weight. Wider weights (the GDN and attention input projections, the LM head)
keep cuBLAS, which tiles them well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.ops import small_linear
from hybridspec.ops.linear import fits

# the widest weight (output features) sent to small_linear; above it cuBLAS's grid fills the chip
MAX_FEATURES = 4096


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) on `x` `[..., K]`, through `small_linear` on CUDA where the
    rows are few and the weight narrow. Where autograd records (the drafter's training forward) it
    is `F.linear`: the op has no backward (`fits` says no)."""
    flat = x.reshape(-1, x.shape[-1])
    if x.is_cuda and weight.shape[0] <= MAX_FEATURES and fits(flat, weight):
        return small_linear(flat, weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def call(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`mod(x)`, through `linear` where `mod` is a plain bias-free `nn.Linear` without hooks (a hook
    or an adapter in its place changes what it computes, so those run as they are)."""
    if type(mod) is nn.Linear and mod.bias is None and not mod._forward_hooks and not mod._forward_pre_hooks:
        return linear(x, mod.weight)
    return mod(x)
