"""`patches.common.moe_gemm` / `_down`: the MoE block's narrow GEMMs, and its router tail on CUDA.
On the GPU the GEMMs take `small_linear` where it accepts the inputs; a hooked or biased down
projection, more than 64 rows, or a product autograd records run as before; on the CPU `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.ops.dispatch import launch_counts
from hybridspec.patches.common import _down, moe_gemm


def _launches(fn) -> int:
    before = launch_counts["small_linear"]
    fn()
    return launch_counts["small_linear"] - before


def test_cpu_is_f_linear_and_hooks_run():
    lin = nn.Linear(16, 8, bias=False)
    x = torch.randn(2, 3, 16)
    assert _launches(lambda: moe_gemm(x, lin.weight)) == 0
    assert torch.equal(moe_gemm(x, lin.weight), F.linear(x, lin.weight))
    seen = []
    lin.register_forward_hook(lambda *a: seen.append(1))
    assert torch.equal(_down(lin, x), lin(x))
    assert seen == [1, 1], "a hooked down projection must run through its module call"
    # an instance-level forward (transformers' tensor-parallel styles, accelerate's hooks install one)
    other = nn.Linear(16, 8, bias=False)
    other.forward = lambda t: nn.Linear.forward(other, t) * 2
    assert torch.equal(_down(other, x), 2 * F.linear(x, other.weight))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_takes_small_linear_where_it_applies(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(512, 1296, bias=False, device="cuda", dtype=dtype)
    x = torch.randn(1, 3, 512, device="cuda", dtype=dtype)
    with torch.no_grad():
        assert _launches(lambda: moe_gemm(x, lin.weight)) == 1
        assert _launches(lambda: _down(lin, x)) == 1
        got, ref = moe_gemm(x, lin.weight), lin(x)
        assert got.shape == ref.shape == (1, 3, 1296)
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)
        biased = nn.Linear(512, 64, device="cuda", dtype=dtype)
        many = torch.randn(65, 512, device="cuda", dtype=dtype)
        assert _launches(lambda: _down(biased, x)) == 0
        assert _launches(lambda: moe_gemm(many, lin.weight)) == 0
    # autograd records (a training forward): the op has no backward
    assert _launches(lambda: moe_gemm(x, lin.weight).float().sum().backward()) == 0
    assert lin.weight.grad is not None


@pytest.mark.gpu
def test_cuda_router_tail_takes_route_topk_but_not_under_autograd():
    from types import SimpleNamespace

    from hybridspec.patches.common import route_logits

    family, router = SimpleNamespace(router_normalizes=lambda r: True), SimpleNamespace(top_k=8)
    logits = torch.randn(16, 256, device="cuda")
    before = launch_counts["route_topk"]
    with torch.no_grad():
        weights, ids = route_logits(family, router, logits)
    assert launch_counts["route_topk"] == before + 1 and ids.shape == weights.shape == (16, 8)
    trained = logits.clone().requires_grad_()
    weights, _ = route_logits(family, router, trained)
    weights.sum().backward()
    assert launch_counts["route_topk"] == before + 1 and trained.grad is not None
