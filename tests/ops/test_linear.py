"""small_linear kernel against the naive twin (hybridspec.ops.naive_linear: fp32 accumulation,
one rounding), on row-strided inputs and row slices of wider weights, and `fits`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import naive_linear, small_linear
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
