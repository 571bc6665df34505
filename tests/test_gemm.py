"""`hybridspec.gemm`: which GEMM a projection runs on. On the GPU a plain few-row narrow linear takes
`small_linear`; a hooked or biased module, a wide weight, many rows, or a product autograd records
run as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridspec import gemm
from hybridspec.ops.dispatch import launch_counts


def _launches(fn) -> int:
    before = launch_counts["small_linear"]
    fn()
    return launch_counts["small_linear"] - before


def test_cpu_runs_the_module_as_it_is():
    lin = nn.Linear(16, 8, bias=False)
    x = torch.randn(3, 16)
    seen = []
    assert torch.equal(gemm.call(lin, x), lin(x))
    lin.register_forward_hook(lambda *a: seen.append(1))
    gemm.call(lin, x)
    assert seen == [1], "a hooked linear must run through its module call"
    assert _launches(lambda: gemm.call(nn.Linear(16, 8, bias=False), x)) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_picks_small_linear_where_it_applies(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(512, 1296, bias=False, device="cuda", dtype=dtype)
    x = torch.randn(1, 3, 512, device="cuda", dtype=dtype)
    with torch.no_grad():
        assert _launches(lambda: gemm.call(lin, x)) == 1
        got, ref = gemm.call(lin, x), lin(x)
        assert got.shape == ref.shape == (1, 3, 1296)
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)
        wide = nn.Linear(512, gemm.MAX_FEATURES + 16, bias=False, device="cuda", dtype=dtype)
        biased = nn.Linear(512, 64, device="cuda", dtype=dtype)
        many = torch.randn(65, 512, device="cuda", dtype=dtype)
        assert _launches(lambda: gemm.call(wide, x)) == 0
        assert _launches(lambda: gemm.call(biased, x)) == 0
        assert _launches(lambda: gemm.call(lin, many)) == 0
    # the drafter's training forward: autograd records, and the op has no backward
    assert _launches(lambda: gemm.call(lin, x).float().sum().backward()) == 0
    assert lin.weight.grad is not None
