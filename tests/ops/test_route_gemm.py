"""`route_gemm_topk` (the router's split-K GEMM whose last program routes) against the two launches
it replaces (`small_linear_partials`, `route_topk_partials`: the same bits), against the naive twin,
and in the verification forward of both families at one row."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import linear as linear_ops
from hybridspec.ops import naive_linear, naive_route, route_topk_partials, small_linear_partials
from hybridspec.ops.route_gemm import new_counter, route_gemm_topk
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch


def make_inputs(M, E, extra, K, dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype).to(device)
    w = (torch.randn(E + extra, K, generator=gen) * K**-0.5).to(dtype).to(device)
    return x, w


def run_both(x, w, splits, E, k, normalize, device):
    counter = new_counter(device)
    with expect_launch("route_gemm_topk"):
        fused = route_gemm_topk(x, w, splits, E, k, normalize=normalize, counter=counter)
    two = route_topk_partials(small_linear_partials(x, w, splits), E, k, normalize=normalize, dtype=x.dtype)
    return fused, two, counter


@settings(max_examples=15, deadline=None)
@given(M=st.sampled_from([1, 2, 3, 17]), E=st.sampled_from([4, 16, 40]), extra=st.sampled_from([0, 1, 20]),
       K=st.sampled_from([16, 48, 96]), splits=st.sampled_from([1, 2, 4]), k=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), normalize=st.booleans(), seed=st.integers(0, 2**16))
@example(M=1, E=16, extra=1, K=96, splits=4, k=2, dtype=torch.bfloat16, normalize=True, seed=0)
def test_equals_the_two_launches(device, M, E, extra, K, splits, k, dtype, normalize, seed):
    """The same bits as the partials and the routing kernel apart, the counter back at zero, and
    the naive twin's choice (random logits: no near ties at these sizes)."""
    x, w = make_inputs(M, E, extra, K, dtype, seed, device)
    (weights, ids, rest), (w2, i2, r2), counter = run_both(x, w, splits, E, k, normalize, device)
    assert torch.equal(ids, i2) and torch.equal(weights, w2) and torch.equal(rest, r2)
    assert int(counter.item()) == 0
    ref_w, ref_i, ref_r = naive_route.route_topk_partials(
        naive_linear.small_linear_partials(x.cpu(), w.cpu(), splits), E, k, normalize, dtype)
    assert torch.equal(ids.cpu(), ref_i)
    assert_rel(weights.float().cpu(), ref_w.float(), 2**-7, "weights vs twin")
    if extra:
        assert_rel(rest.float().cpu(), ref_r.float(), 2**-7, "rest vs twin")


def test_counter_resets_between_launches(device):
    """Repeated launches on one counter give the same results (the last program sets it back)."""
    x, w = make_inputs(1, 16, 1, 64, torch.float32, 1, device)
    counter = new_counter(device)
    first = route_gemm_topk(x, w, 4, 16, 2, normalize=True, counter=counter)
    for _ in range(3):
        again = route_gemm_topk(x, w, 4, 16, 2, normalize=True, counter=counter)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert int(counter.item()) == 0


def test_opcheck(device):
    x, w = make_inputs(2, 16, 3, 32, torch.float32, 2, device)
    op = torch.ops.hybridspec.route_gemm_topk.default
    torch.library.opcheck(op, (x, w, 2, 16, 2, True, new_counter(device)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(splits=0), r"splits must be an int in 1..16, got 0"),
        (dict(experts=20), r"experts must be an int in 1..min\(N, 1024\) = 1..17, got 20"),
        (dict(k=17), r"k must be an int with 1 <= k <= experts = 16, got 17"),
        (dict(counter=torch.zeros(1, dtype=torch.int64)), r"counter must be an int32 \[1\] tensor on cpu"),
        (dict(counter=torch.zeros(2, dtype=torch.int32)), r"counter must be an int32 \[1\] tensor on cpu"),
    ],
)
def test_wrapper_validates(kwargs, match):
    x, w = make_inputs(1, 16, 1, 32, torch.float32, 3, "cpu")
    args = dict(splits=2, experts=16, k=2, counter=new_counter("cpu")) | kwargs
    with pytest.raises(ValueError, match=match):
        route_gemm_topk(x, w, args["splits"], args["experts"], args["k"], normalize=True, counter=args["counter"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("E, extra", [(256, 16), (512, 16)])
def test_real_shapes(dtype, E, extra):
    """The 35B-A3B and Qwen3-Next blocks' fused router rows at one row, many launches on one counter."""
    counter = new_counter("cuda")
    for seed in range(20):
        x, w = make_inputs(1, E, extra, 2048, dtype, seed, "cuda")
        fused = route_gemm_topk(x, w, 4, E, 8, normalize=True, counter=counter)
        two = route_topk_partials(small_linear_partials(x, w, 4), E, 8, normalize=True, dtype=dtype)
        assert all(torch.equal(a, b) for a, b in zip(fused, two))
    assert int(counter.item()) == 0


@pytest.mark.parametrize("family_model", ["qwen35", "qwen3_next"])
def test_verification_at_one_row(device, monkeypatch, family_model):
    """A one-token verified block (an AR step) routes every sparse block in one launch, with the
    hidden states of the two-launch path (the same bits) and transformers' (fp32 tiny models); at
    more rows than `router_fused_rows` the two launches run."""
    from transformers import DynamicCache

    from hybridspec.patches import family_of
    from hybridspec.patches.common import is_sparse_moe
    from hybridspec.patches.forward import allocate_state, verify_forward
    from hybridspec.patches.fusion import fuse_model
    from tests.models import VOCAB, qwen3_next_causal_lm, qwen35_causal_lm

    build = qwen35_causal_lm if family_model == "qwen35" else qwen3_next_causal_lm
    model = build(seed=21).to(device)
    family = family_of(model)
    fuse_model(family, model)
    sparse = sum(is_sparse_moe(layer.mlp) for layer in family.text_model(model).layers)
    g = torch.Generator().manual_seed(22)
    prompt = torch.randint(0, VOCAB, (1, 7), generator=g).to(device)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, use_cache=True, past_key_values=cache)
        state = allocate_state(family, model, cache, 32)
        one, two = (torch.randint(0, VOCAB, (1, n), generator=g).to(device) for n in (1, 2))
        monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", linear_ops.LinearKernelConfig(router_fused_rows=0))
        plain, _ = verify_forward(family, model, one, state)
        monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", linear_ops.LinearKernelConfig(router_fused_rows=1))
        with expect_launch("route_gemm_topk", sparse):
            got, _ = verify_forward(family, model, one, state)
        with expect_launch("route_gemm_topk", 0):
            verify_forward(family, model, two, state)
        full = model(torch.cat([prompt, one], 1), output_hidden_states=True).hidden_states[-1][:, -1:]
    assert torch.equal(got, plain)
    assert_rel(got.cpu(), full.cpu(), 1e-5, "one-launch router vs transformers")
