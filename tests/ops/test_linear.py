"""small_linear kernel against the naive twin (hybridspec.ops.naive_linear: fp32 accumulation,
one rounding), on row-strided inputs and row slices of wider weights, and `fits`; its split-K form
`small_linear_partials` against its twin, and `split_out_projection` built on it (the target's
mixers and the drafter's layers)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import linear as linear_ops
from hybridspec.ops import naive_linear, small_linear, small_linear_partials
from hybridspec.ops.dispatch import use_triton
from hybridspec.ops.linear import fits
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch

# fp32: another summation order (and 3xTF32 on the GPU); 16-bit: the same fp32 sum rounded once on
# both sides, a one-ulp difference where the two orders straddle a rounding boundary
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LinearCase:
    M: int
    N: int
    K: int
    dtype: torch.dtype
    seed: int
    # x's row stride past K (x a column slice of a wider activation)
    x_pad: int = 0
    # the weight as rows [w_off, w_off + N) and columns [0, K) of a wider buffer (a fused weight)
    w_off: int = 0
    w_pad: int = 0


def make_inputs(case: LinearCase, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x and weight; what of their buffers lies outside them is NaN, so a read past a mask fails."""
    gen = torch.Generator().manual_seed(case.seed)
    M, N, K = case.M, case.N, case.K
    x = torch.full((M, K + case.x_pad), float("nan"))
    x[:, :K] = torch.randn(M, K, generator=gen)
    w = torch.full((case.w_off + N + 3 * (case.w_off > 0), K + case.w_pad), float("nan"))
    w[case.w_off:case.w_off + N, :K] = torch.randn(N, K, generator=gen) * K**-0.5
    x = x.to(case.dtype).to(device)[:, :K]
    w = w.to(case.dtype).to(device)[case.w_off:case.w_off + N, :K]
    return x, w


@st.composite
def linear_cases(draw):
    sliced = draw(st.booleans(), label="weight sliced")
    return LinearCase(
        M=draw(st.sampled_from([1, 2, 5, 16, 17, 64]), label="M"),
        N=draw(st.sampled_from([1, 7, 16, 33, 100]), label="N"),
        K=draw(st.sampled_from([1, 16, 40, 300]), label="K"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        seed=draw(st.integers(0, 2**16), label="seed"),
        x_pad=draw(st.sampled_from([0, 0, 5]), label="x_pad"),
        w_off=draw(st.sampled_from([2, 9]), label="w_off") if sliced else 0,
        w_pad=draw(st.sampled_from([0, 4]), label="w_pad") if sliced else 0,
    )


def check_against_naive(case: LinearCase, x: torch.Tensor, w: torch.Tensor, got: torch.Tensor) -> None:
    assert got.dtype == case.dtype and got.shape == (case.M, case.N) and got.is_contiguous()
    got, ref = got.cpu(), naive_linear.small_linear(x.cpu(), w.cpu())
    assert_rel(got, ref, TOL[case.dtype], f"small_linear {case}")
    if case.dtype != torch.float32:
        # the norm-wise tolerance lets a truncating cast through (2**-9 here); rounding the same fp32
        # sum to nearest leaves a differing element only where two summation orders straddle a tie
        differ = int((got != ref).sum())
        assert differ <= max(1, got.numel() // 100), f"{differ} of {got.numel()} elements differ from the twin"


def _run(case: LinearCase, device: str):
    x, w = make_inputs(case, device)
    with expect_launch("small_linear"):
        got = small_linear(x, w)
    return x, w, got


@settings(max_examples=20)
@given(case=linear_cases())
@example(case=LinearCase(M=64, N=100, K=300, dtype=torch.bfloat16, seed=0, x_pad=5, w_off=9, w_pad=4))
@example(case=LinearCase(M=17, N=33, K=300, dtype=torch.float32, seed=1))
@example(case=LinearCase(M=1, N=1, K=1, dtype=torch.float16, seed=2, w_off=2))
def test_matches_naive(device, case):
    x, w, got = _run(case, device)
    check_against_naive(case, x, w, got)


def test_deterministic_and_twin_is_f_linear(device):
    """Two calls give the same bits (no split-K, no atomics); the twin is F.linear's math (fp32
    accumulation, one rounding), which torch's CPU bf16 GEMM also computes."""
    case = LinearCase(M=5, N=40, K=300, dtype=torch.bfloat16, seed=3, x_pad=3, w_off=2, w_pad=4)
    x, w, first = _run(case, device)
    assert torch.equal(first, small_linear(x, w))
    check_against_naive(case, x, w, first)
    x, w = x.cpu(), w.cpu()
    assert_rel(F.linear(x, w), naive_linear.small_linear(x, w), 2**-8, "F.linear")


def test_opcheck(device):
    x, w = make_inputs(LinearCase(M=3, N=20, K=16, dtype=torch.float32, seed=4, w_off=2, w_pad=4), device)
    op = torch.ops.hybridspec.small_linear.default
    torch.library.opcheck(op, (x, w))
    torch.library.opcheck(op, (x.bfloat16(), w.bfloat16()))


def test_fullgraph_compile(device):
    x, w = make_inputs(LinearCase(M=5, N=24, K=16, dtype=torch.float32, seed=5), device)

    def project(x, w):
        return small_linear(x * 2, w) + 1

    eager = project(x, w)
    compiled = torch.compile(project, fullgraph=True)(x, w)
    assert torch.equal(eager, compiled)


def test_fits():
    x, w = make_inputs(LinearCase(M=4, N=20, K=16, dtype=torch.bfloat16, seed=6, w_off=2, w_pad=4), "cpu")
    assert fits(x, w) == use_triton(x)
    for bad_x, bad_w in [
        (x[0], w), (x[:0], w), (torch.zeros(65, 16, dtype=x.dtype), w), (x, w[:, :8]),
        (x.float(), w), (x.double(), w.double()), (x.t().contiguous().t(), w), (x, w.to("meta")),
        (x, w.clone().requires_grad_()),
    ]:
        assert not fits(bad_x, bad_w)
    with torch.no_grad():
        assert fits(x, w.clone().requires_grad_()) == use_triton(x)

    class Wrapped(torch.Tensor):
        """A tensor subclass (as a DTensor or a quantized weight is one): not plain strided memory."""

    assert not fits(x, w.as_subclass(Wrapped)) and not fits(x.as_subclass(Wrapped), w)
    assert fits(x, torch.nn.Parameter(w.clone(), requires_grad=False)) == use_triton(x)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x, w: (x[0], w), r"x must be \[M, K\] with M >= 1 and K >= 1, got \(16,\)"),
        (lambda x, w: (x[:0], w), r"x must be \[M, K\] with M >= 1 and K >= 1, got \(0, 16\)"),
        (lambda x, w: (x.new_zeros(65, 16), w), r"x \[M, K\] = \(65, 16\): at most 64 rows"),
        (lambda x, w: (x, w[:, :8]), r"weight must be \[N, K\] = \[N, 16\] with N >= 1, got \(20, 8\)"),
        (lambda x, w: (x, w[:0]), r"weight must be \[N, K\] = \[N, 16\] with N >= 1, got \(0, 16\)"),
        (lambda x, w: (x, w[0]), r"weight must be \[N, K\] = \[N, 16\] with N >= 1, got \(16,\)"),
        (lambda x, w: (x.double(), w.double()), "x must be fp32, bf16 or fp16, got torch.float64"),
        (lambda x, w: (x, w.bfloat16()), r"weight \(torch.bfloat16\) must have x's dtype torch.float32"),
        (lambda x, w: (x.t().contiguous().t(), w),
         r"contiguous in their last dim, got strides \(1, 3\) and \(16, 1\)"),
        (lambda x, w: (x, w.t().contiguous().t()),
         r"contiguous in their last dim, got strides \(16, 1\) and \(1, 20\)"),
        (lambda x, w: (x, w.to("meta")), "weight is on meta, x on cpu"),
    ],
)
def test_wrapper_validates(change, match):
    x, w = make_inputs(LinearCase(M=3, N=20, K=16, dtype=torch.float32, seed=7), "cpu")
    with pytest.raises(ValueError, match=match):
        small_linear(*change(x, w))


# (N, K): the 35B-A3B MoE block's fused weight with the shared expert's projections (1296 rows) and
# without them (router + shared gate, padded to 272: the live shape where the experts op runs the
# shared expert), the shared expert's down projection, attention o_proj / GDN out_proj, and an N one
# past a tile
GPU_CASES = [
    LinearCase(M=M, N=N, K=K, dtype=dtype, seed=M + N)
    for N, K in ((1296, 2048), (272, 2048), (2048, 512), (2048, 4096), (257, 2048))
    for M in (1, 16, 64) for dtype in (torch.bfloat16, torch.float32)
] + [LinearCase(M=7, N=1296, K=2048, dtype=torch.bfloat16, seed=1, x_pad=8, w_off=256, w_pad=64)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"M{c.M}-N{c.N}-K{c.K}-{c.dtype}-off{c.w_off}")
def test_real_shapes(case):
    x, w, got = _run(case, "cuda")
    check_against_naive(case, x, w, got)
    assert torch.equal(got, small_linear(x, w))
    assert_rel(got, F.linear(x, w), TOL[case.dtype], "vs F.linear")


# fp32 partials on both sides: products exact (16-bit inputs) or 3xTF32 (fp32), sums in another order
PARTIALS_TOL = 1e-5


@settings(max_examples=20)
@given(case=linear_cases(), splits=st.sampled_from([1, 2, 3, 4, 16]))
@example(case=LinearCase(M=16, N=33, K=300, dtype=torch.bfloat16, seed=8, x_pad=5, w_off=9, w_pad=4), splits=4)
@example(case=LinearCase(M=1, N=7, K=40, dtype=torch.float32, seed=9), splits=16)
def test_partials_match_naive(device, case, splits):
    """Each split's fp32 partial sum is its twin's (the same columns of K, `split_span`; the splits
    past K are zeros), and their sum rounded once is `small_linear`'s result."""
    x, w = make_inputs(case, device)
    with expect_launch("small_linear_partials"):
        got = small_linear_partials(x, w, splits)
    assert got.shape == (splits, case.M, case.N) and got.dtype == torch.float32 and got.is_contiguous()
    got, x, w = got.cpu(), x.cpu(), w.cpu()
    ref = naive_linear.small_linear_partials(x, w, splits)
    assert_rel(got, ref, PARTIALS_TOL, f"partials {case} splits={splits}")
    span = naive_linear.split_span(case.K, splits)
    assert torch.equal(got[-(-case.K // span):], torch.zeros_like(got[-(-case.K // span):]))
    check_against_naive(case, x, w, got.sum(0).to(case.dtype))


def test_split_span_covers_k_once():
    for K in (1, 15, 16, 17, 300, 4096):
        for splits in (1, 2, 3, 4, 7, 16):
            span = naive_linear.split_span(K, splits)
            assert span % 16 == 0 and span * splits >= K and span * (splits - 1) < K + 16 * splits
    x, w = make_inputs(LinearCase(M=3, N=5, K=300, dtype=torch.float32, seed=10), "cpu")
    assert_rel(naive_linear.small_linear_partials(x, w, 3).sum(0), x @ w.T, 1e-6, "twin's splits add up")


def test_partials_opcheck(device):
    x, w = make_inputs(LinearCase(M=3, N=20, K=40, dtype=torch.float32, seed=11, w_off=2, w_pad=4), device)
    op = torch.ops.hybridspec.small_linear_partials.default
    torch.library.opcheck(op, (x, w, 3))
    torch.library.opcheck(op, (x.bfloat16(), w.bfloat16(), 2))


@pytest.mark.parametrize("splits, match", [(0, "splits must be an int in 1..16, got 0"),
                                           (17, "splits must be an int in 1..16, got 17"),
                                           (2.0, "splits must be an int in 1..16, got 2.0")])
def test_partials_wrapper_validates(splits, match):
    x, w = make_inputs(LinearCase(M=3, N=20, K=16, dtype=torch.float32, seed=12), "cpu")
    with pytest.raises(ValueError, match=match):
        small_linear_partials(x, w, splits)
    with pytest.raises(ValueError, match=r"at most 64 rows"):
        small_linear_partials(x.new_zeros(65, 16), w, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_out_projection(device, monkeypatch, dtype):
    """Off at `out_split_k` 1 (None: the caller runs the linear); with it set, one partials
    launch whose sum is the linear's output, eager and inside a fullgraph compile with a residual
    add after it; a linear with a bias (not `plain_unsharded`) is left to its caller."""
    from hybridspec.split_projection import split_out_projection

    torch.manual_seed(13)
    lin = torch.nn.Linear(80, 24, bias=False).to(device=device, dtype=dtype)
    x = torch.randn(2, 5, 80, device=device, dtype=dtype)
    monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", linear_ops.LinearKernelConfig(out_split_k=1))
    assert split_out_projection(lin, x) is None
    monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", linear_ops.LinearKernelConfig(out_split_k=4))
    with torch.no_grad():
        with expect_launch("small_linear_partials"):
            got = split_out_projection(lin, x)
        assert got.shape == (2, 5, 24) and got.dtype == dtype
        assert_rel(got.float().cpu(), lin(x).float().cpu(), TOL[dtype], "split out projection")
        h = torch.randn(2, 5, 24, device=device, dtype=dtype)
        compiled = torch.compile(lambda h, x: h + split_out_projection(lin, x), fullgraph=True)(h, x)
        assert_rel(compiled.float().cpu(), (h + got).float().cpu(), TOL[dtype], "compiled")
        biased = torch.nn.Linear(80, 24).to(device=device, dtype=dtype)
        assert split_out_projection(biased, x) is None


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_partials_real_shapes(M, dtype):
    """The mixers' output projections (N 2048, K 4096) in 4 splits, against F.linear."""
    case = LinearCase(M=M, N=2048, K=4096, dtype=dtype, seed=M)
    x, w = make_inputs(case, "cuda")
    got = small_linear_partials(x, w, 4)
    assert torch.equal(got, small_linear_partials(x, w, 4))
    assert_rel(got.cpu(), naive_linear.small_linear_partials(x.cpu(), w.cpu(), 4), PARTIALS_TOL, "vs twin")
    assert_rel(got.sum(0).to(dtype), F.linear(x, w), TOL[dtype], "vs F.linear")


# the path without either split (both on by default), the baseline of the split tests
UNSPLIT = linear_ops.LinearKernelConfig(out_split_k=1, router_split_k=1, in_split_k=1)


@pytest.mark.parametrize("split", ["out", "router", "in"])
@pytest.mark.parametrize("family_model", ["qwen35", "qwen3_next"])
def test_verification_with_split_out_projections(device, monkeypatch, family_model, split):
    """A verified block through the kernels with every mixer's output projection split 4 ways
    ("out": one partials launch per decoder layer), every mixer's fused input projection split 4
    ways ("in": the same), or every MoE block's router GEMM split 4 ways and added by
    `route_topk_partials` ("router": one such launch per sparse block), gives the hidden states the
    unsplit path gives, and transformers' (fp32 tiny models)."""
    from transformers import DynamicCache

    from hybridspec.patches import family_of
    from hybridspec.patches.common import is_sparse_moe
    from hybridspec.patches.forward import allocate_state, verify_forward
    from hybridspec.patches.fusion import fuse_model
    from tests.models import VOCAB, qwen3_next_causal_lm, qwen35_causal_lm

    build = qwen35_causal_lm if family_model == "qwen35" else qwen3_next_causal_lm
    model = build(seed=14).to(device)
    family = family_of(model)
    # the router's split runs over the block's fused weight (as a Target fuses on construction)
    fuse_model(family, model)
    if split in ("out", "in"):
        config = replace(UNSPLIT, **{f"{split}_split_k": 4})
        launch, layers = "small_linear_partials", family.text_config(model).num_hidden_layers
    else:
        config, launch = linear_ops.LinearKernelConfig(out_split_k=1, router_split_k=4, in_split_k=1), "route_topk_partials"
        layers = sum(is_sparse_moe(layer.mlp) for layer in family.text_model(model).layers)
        assert layers >= 2
    g = torch.Generator().manual_seed(15)
    prompt, block = (torch.randint(0, VOCAB, (1, n), generator=g).to(device) for n in (7, 5))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, use_cache=True, past_key_values=cache)
        state = allocate_state(family, model, cache, 32)
        monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", UNSPLIT)
        plain, _ = verify_forward(family, model, block, state)
        monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", config)
        with expect_launch(launch, layers):
            got, _ = verify_forward(family, model, block, state)
        full = model(torch.cat([prompt, block], 1), output_hidden_states=True).hidden_states[-1][:, prompt.shape[1]:]
    assert_rel(got.cpu(), plain.cpu(), 1e-5, "split vs default")
    assert_rel(got.cpu(), full.cpu(), 1e-5, "split vs transformers")


def test_stage0_routes_split_router_as_the_default(device, monkeypatch):
    """Stage 0's router alone (`route` without logits: the fused weight's router rows) split 4 ways
    chooses the experts, with the weights, that the default path chooses."""
    from hybridspec.patches import family_of
    from hybridspec.patches.common import route
    from hybridspec.patches.fusion import fuse_model
    from tests.models import qwen35_causal_lm

    model = qwen35_causal_lm(seed=17).to(device)
    family = family_of(model)
    fuse_model(family, model)
    mlp = family.text_model(model).layers[0].mlp
    y = torch.randn(1, 16, model.config.get_text_config().hidden_size, generator=torch.Generator().manual_seed(18)).to(device)
    with torch.no_grad():
        monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", UNSPLIT)
        ids, weights = route(family, mlp, y)
        monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", linear_ops.LinearKernelConfig(router_split_k=4))
        with expect_launch("route_topk_partials", 1):
            split_ids, split_weights = route(family, mlp, y)
    assert split_ids.shape == ids.shape == (1, 16, mlp.gate.top_k)
    assert torch.equal(split_ids, ids)
    assert_rel(split_weights.cpu(), weights.cpu(), 1e-5, "weights")


def test_drafts_with_split_out_projections(device, monkeypatch):
    """The drafter's rounds with its `o_proj` and MLP `down_proj` split 4 ways draft the tokens the
    default path drafts: two partials launches per layer and round."""
    from tests.models import VOCAB, config, qwen35_causal_lm, random_drafter

    drafter = random_drafter(config()).to(device).bind(qwen35_causal_lm().to(device))
    g = torch.Generator().manual_seed(16)
    features = torch.randn(1, 20, drafter.fc.in_features, generator=g).to(device)
    anchor = torch.randint(0, VOCAB, (1,), generator=g).to(device)

    def draft():
        drafter.reset(1, max_length=48)
        drafter.observe(features, 20)
        return drafter.propose(anchor)

    with torch.no_grad():
        monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", UNSPLIT)
        plain = draft()
        monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", linear_ops.LinearKernelConfig(out_split_k=4))
        with expect_launch("small_linear_partials", 2 * len(drafter.layers)):
            split = draft()
    assert torch.equal(split.tokens, plain.tokens)
    assert_rel(split.confidence.cpu(), plain.confidence.cpu(), 1e-5, "confidence")


def test_tiles_widen_past_16_rows_while_the_grid_stays_full():
    """Above 16 rows each program reads all M rows of x: the tile widens to `wide_block_n` (as much
    x as weight per program) unless the grid would fall under `min_programs` (the router's 257
    outputs), and at 16 rows or fewer it is `block_n`."""
    cfg = linear_ops.LinearKernelConfig()
    assert linear_ops._tiles(cfg, 16, 2048, 4096, 4, 2)[1] == cfg.block_n == 16
    assert linear_ops._tiles(cfg, 64, 2048, 4096, 4, 2)[:2] == (64, 64)
    assert linear_ops._tiles(cfg, 64, 257, 2048, 4, 2)[1] == 16
    assert linear_ops._tiles(cfg, 32, 1024, 2048, 4, 2)[1] == 32
    assert linear_ops._tiles(replace(cfg, wide_block_n=16), 64, 2048, 4096, 4, 2)[1] == 16
