"""route_topk kernel against the naive twin (hybridspec.ops.naive_route: fp32 softmax, a stable
descending sort, renormalisation, cast), exact ties to the lowest index, and the twin against
transformers' router math."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import naive_route, route_topk, route_topk_partials
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch

# fp32: the same softmax and divisions as the twin, other exp and summation orders (the GPU's exp is
# ex2.approx after a multiply by log2 e: a few ulp); 16-bit: one rounding of the weight either way
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RouteCase:
    R: int
    E: int
    k: int
    dtype: torch.dtype
    normalize: bool
    # "distinct": no two logits of a row equal, at least 1/256 apart (probabilities 0.4% apart, so
    # the order is the twin's exactly); "ties": a coarse grid, exact ties everywhere; "normal": Gaussian
    data: str
    seed: int
    # row stride past E (logits a slice of a wider tensor)
    pad: int = 0


def _distinct_values(dtype: torch.dtype) -> torch.Tensor:
    """Distinct values of `dtype` in [-8, 8), at least 1/256 apart (over 1024 of them in bf16)."""
    return (torch.arange(-2048, 2048) / 256).to(dtype).unique()


def make_logits(case: RouteCase, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed)
    R, E = case.R, case.E
    if case.data == "distinct":
        values = _distinct_values(case.dtype)
        logits = torch.stack([values[torch.randperm(len(values), generator=gen)[:E]] for _ in range(R)])
    elif case.data == "ties":
        logits = torch.randint(-3, 4, (R, E), generator=gen) / 2
    else:
        logits = torch.randn(R, E, generator=gen) * 3
    wide = torch.full((R, E + case.pad), float("nan"))
    wide[:, :E] = logits
    return wide.to(case.dtype).to(device)[:, :E]


@st.composite
def route_cases(draw):
    E = draw(st.one_of(st.integers(1, 40), st.sampled_from([64, 255, 256, 300, 512, 1024])), label="E")
    return RouteCase(
        R=draw(st.sampled_from([1, 2, 5, 9]), label="R"),
        E=E,
        k=draw(st.one_of(st.integers(1, min(E, 12)), st.just(E)), label="k"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        normalize=draw(st.booleans(), label="normalize"),
        data=draw(st.sampled_from(["distinct", "ties", "normal"]), label="data"),
        seed=draw(st.integers(0, 2**16), label="seed"),
        pad=draw(st.sampled_from([0, 0, 3]), label="pad"),
    )


def check_against_naive(case: RouteCase, logits: torch.Tensor, got) -> None:
    weights, ids = (t.cpu() for t in got)
    ref_w, ref_ids = naive_route.route_topk(logits.cpu(), case.k, case.normalize)
    assert weights.dtype == case.dtype and ids.dtype == torch.long
    assert weights.shape == ids.shape == (case.R, case.k)
    assert ((ids >= 0) & (ids < case.E)).all(), "an id out of range"
    assert all(len(set(row)) == case.k for row in ids.tolist()), "an expert chosen twice"
    if case.data in ("distinct", "ties"):
        assert torch.equal(ids, ref_ids), f"ids {ids.tolist()} != twin's {ref_ids.tolist()}"
    else:
        # Gaussian fp32 logits may hold near-ties the two softmaxes order differently: the
        # probabilities chosen must be the twin's, rank by rank
        probs = torch.softmax(logits.cpu(), dim=-1, dtype=torch.float32)
        torch.testing.assert_close(probs.gather(1, ids), probs.gather(1, ref_ids), rtol=4e-6, atol=0)
        same = (ids == ref_ids).all(dim=1)
        weights, ref_w = weights[same], ref_w[same]
    assert_rel(weights, ref_w, TOL[case.dtype], "weights")


def _run(case: RouteCase, device: str):
    logits = make_logits(case, device)
    with expect_launch("route_topk"):
        got = route_topk(logits, case.k, normalize=case.normalize)
    return logits, got


@settings(max_examples=24)
@given(case=route_cases())
@example(case=RouteCase(R=3, E=256, k=8, dtype=torch.bfloat16, normalize=True, data="distinct", seed=0))
@example(case=RouteCase(R=2, E=512, k=10, dtype=torch.float32, normalize=False, data="normal", seed=1, pad=3))
@example(case=RouteCase(R=2, E=1024, k=1024, dtype=torch.float16, normalize=True, data="ties", seed=2))
@example(case=RouteCase(R=1, E=1, k=1, dtype=torch.float32, normalize=True, data="normal", seed=3))
def test_matches_naive(device, case):
    logits, got = _run(case, device)
    check_against_naive(case, logits, got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_pick_the_lowest_index(device, dtype):
    """Equal probabilities in any order of indices, across the k boundary, at probability 0
    (underflowed and -inf logits) and past the padding of E = 300 to 512 lanes: the lowest index
    comes first, and padding lanes are never chosen."""
    E = 300
    logits = torch.full((5, E), -4.0)
    logits[:, :E].add_(torch.arange(E) % 7 / 8)  # the background: below 0, ties of its own
    a, b, c, d = 7, 100, 260, 299
    logits[0, [c, a, b]] = 5.0  # three tied on top
    logits[1, [c, a, b]] = 5.0
    logits[1, d] = 6.0
    logits[2] = 1.0  # a whole row tied
    logits[3] = float("-inf")  # a row of -inf but two experts: the rest have probability 0
    logits[3, [b, c]] = 0.0
    logits[4] = -30000.0  # probability 0 by underflow, all but one
    logits[4, d] = 30000.0 if dtype != torch.float16 else 60000.0
    logits = logits.to(dtype).to(device)
    for k, expected in [
        (2, [[a, b], [d, a], [0, 1], [b, c], [d, 0]]),
        (4, [[a, b, c, 6], [d, a, b, c], [0, 1, 2, 3], [b, c, 0, 1], [d, 0, 1, 2]]),
    ]:
        for normalize in (True, False):
            with expect_launch("route_topk"):
                weights, ids = route_topk(logits, k, normalize=normalize)
            assert ids.tolist() == expected, f"k={k}: {ids.tolist()}"
            case = RouteCase(R=5, E=E, k=k, dtype=dtype, normalize=normalize, data="ties", seed=0)
            check_against_naive(case, logits, (weights, ids))
    weights, ids = route_topk(logits, E)
    assert ids[2].tolist() == list(range(E)) and ids[4, 1:].tolist() == [i for i in range(E) if i != d]
    assert (weights[2].float() - 1 / E).abs().max() <= (1 / E) * TOL[dtype]


def test_twin_sorts_like_topk():
    """On distinct probabilities the twin's stable sort gives torch.topk's order and values."""
    for dtype in DTYPES:
        for E, k in [(256, 8), (512, 10), (33, 33)]:
            case = RouteCase(R=16, E=E, k=k, dtype=dtype, normalize=False, data="distinct", seed=E + k)
            logits = make_logits(case, "cpu")
            weights, ids = naive_route.route_topk(logits, k, normalize=False)
            values, top = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), k, sorted=True)
            assert torch.equal(ids, top)
            assert torch.equal(weights, values.to(dtype))


# Qwen3_5MoeTopKRouter always renormalises; Qwen3NextTopKRouter as `norm_topk_prob` says
@pytest.mark.parametrize("family, normalize", [("qwen3_5_moe", True), ("qwen3_next", True), ("qwen3_next", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_is_the_routers_math(family, normalize, dtype):
    """The twin on `F.linear(hidden, router.weight)` gives transformers' router scores and indices."""
    H, E, k = 32, 64, 8
    if family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

        router = Qwen3_5MoeTopKRouter(Qwen3_5MoeTextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k))
    else:
        from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

        router = Qwen3NextTopKRouter(Qwen3NextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k,
                                                     norm_topk_prob=normalize))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen) * H**-0.5)
        router = router.to(dtype)
        hidden = (torch.randn(40, H, generator=gen) * 2).to(dtype)
        logits, scores, indices = router(hidden)
    weights, ids = naive_route.route_topk(logits, k, normalize)
    # bf16 logits may tie exactly; torch.topk orders those its own way
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, indices))
    untied = (ids == indices).all(dim=1)
    assert untied.sum() >= 30
    assert torch.equal(weights[untied], scores[untied])


def test_strided_rows(device):
    """Logits that are a column slice of a wider tensor (the router's output sliced per rank)."""
    case = RouteCase(R=4, E=40, k=6, dtype=torch.float32, normalize=True, data="distinct", seed=5, pad=24)
    logits, got = _run(case, device)
    assert logits.stride(0) == 64
    check_against_naive(case, logits, got)


def test_opcheck(device):
    logits = make_logits(RouteCase(R=3, E=20, k=4, dtype=torch.float32, normalize=True, data="normal", seed=6), device)
    op = torch.ops.hybridspec.route_topk.default
    torch.library.opcheck(op, (logits, 4, True))
    torch.library.opcheck(op, (logits.bfloat16(), 3, False))


def test_fullgraph_compile(device):
    logits = make_logits(RouteCase(R=5, E=24, k=4, dtype=torch.float32, normalize=True, data="normal", seed=7), device)

    def router_tail(logits):
        weights, ids = route_topk(logits * 2, 4)
        return weights * 3, ids + 1

    assert_compiled_equal(router_tail, logits)


def assert_compiled_equal(fn, x) -> None:
    """`fn(x)` and its fullgraph compile give the same bits (fn ends in exact ops only)."""
    for e, c in zip(fn(x), torch.compile(fn, fullgraph=True)(x)):
        assert torch.equal(e, c)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x: (x[0], 4), r"logits must be \[R, E\] with R >= 1 and E >= 1, got \(20,\)"),
        (lambda x: (x[:0], 4), r"logits must be \[R, E\] with R >= 1 and E >= 1, got \(0, 20\)"),
        (lambda x: (x.double(), 4), "logits must be fp32, bf16 or fp16, got torch.float64"),
        (lambda x: (x.t().contiguous().t(), 4), r"contiguous in their last dim, got strides \(1, 3\)"),
        (lambda x: (x, 0), r"k must be an int with 1 <= k <= E = 20, got 0"),
        (lambda x: (x, 21), r"k must be an int with 1 <= k <= E = 20, got 21"),
        (lambda x: (x, 2.0), r"k must be an int with 1 <= k <= E = 20, got 2.0"),
        (lambda x: (x.new_zeros(3, 1025), 4), r"\(3, 1025\): at most 1024 experts per row"),
    ],
)
def test_wrapper_validates(change, match):
    logits = make_logits(RouteCase(R=3, E=20, k=4, dtype=torch.float32, normalize=True, data="normal", seed=8), "cpu")
    with pytest.raises(ValueError, match=match):
        route_topk(*change(logits))


# Qwen3.5/3.6 and the 122B: E = 256, k = 8; Qwen3-Next: E = 512, k = 10; one row to a 64-row batch
GPU_CASES = [
    RouteCase(R=R, E=E, k=k, dtype=dtype, normalize=True, data=data, seed=R + E)
    for E, k in ((256, 8), (512, 10)) for R in (1, 16, 64) for dtype in (torch.bfloat16, torch.float32)
    for data in ("distinct", "normal")
] + [
    RouteCase(R=64, E=512, k=10, dtype=torch.bfloat16, normalize=False, data="ties", seed=1),
    RouteCase(R=1000, E=1024, k=16, dtype=torch.float16, normalize=True, data="normal", seed=2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda c: f"R{c.R}-E{c.E}-k{c.k}-{c.dtype}-{c.data}-n{int(c.normalize)}")
def test_real_shapes(case):
    logits, got = _run(case, "cuda")
    check_against_naive(case, logits, got)


@pytest.mark.gpu
@pytest.mark.parametrize("E, k", [(256, 8), (512, 10)])
def test_same_experts_as_cuda_topk(E, k):
    """What wiring the op into the router rests on (patches/common.py: route_logits): on CUDA it
    chooses the set of experts `torch.topk` chooses on bf16 logits, ties at the k-th place included
    (gatherTopK keeps the lowest indices, as the kernel does), with each expert's weight bitwise
    equal to transformers' but where the two `exp`s differ in the last bit."""
    gen = torch.Generator(device="cuda").manual_seed(E)
    logits = torch.randn(16384, E, device="cuda", generator=gen).to(torch.bfloat16)
    weights, ids = route_topk(logits, k)
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    # in calls of 64 rows, as the router makes them: aten runs another top-k kernel (multi-block)
    # over 4,000 rows of 400 or more values
    top, ref_ids = (torch.cat(t) for t in zip(*(torch.topk(p, k, dim=-1) for p in probs.split(64))))
    ref_w = (top / top.sum(-1, keepdim=True)).to(torch.bfloat16)
    ranked = probs.sort(-1, descending=True).values
    assert (ranked[:, k - 1] == ranked[:, k]).sum() > 500, "too few ties at the k-th place to test the rule"
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    per_expert = torch.zeros_like(probs).scatter_(1, ids, weights.float())
    ref_per_expert = torch.zeros_like(probs).scatter_(1, ref_ids, ref_w.float())
    differ = (per_expert != ref_per_expert).any(-1)
    assert differ.sum() <= 16384 // 1000, f"{int(differ.sum())} rows with another weight"
    assert_rel(per_expert, ref_per_expert, 2**-8, "weights")


# route_topk_partials: the router's GEMM as split-K fp32 partial sums, added in the kernel


@dataclass(frozen=True)
class PartialsCase:
    route: RouteCase
    # splits, and columns past the experts (the block's other fused rows)
    S: int
    rest: int


def make_partials(case: PartialsCase, device: str) -> torch.Tensor:
    """`[S, R, E + rest]` fp32. Split 0 holds the route case's logits (its data kind, exactly: the
    other splits are zero) except for "normal", whose logits are spread over every split."""
    c = case.route
    gen = torch.Generator().manual_seed(c.seed + 1)
    parts = torch.zeros(case.S, c.R, c.E + case.rest)
    parts[0, :, : c.E] = make_logits(RouteCase(c.R, c.E, c.k, torch.float32, c.normalize, c.data, c.seed), "cpu")
    if c.data == "normal":
        parts[1:, :, : c.E] = torch.randn(case.S - 1, c.R, c.E, generator=gen)
    parts[:, :, c.E :] = torch.randn(case.S, c.R, case.rest, generator=gen)
    return parts.to(device)


@st.composite
def partials_cases(draw):
    return PartialsCase(route=draw(route_cases()), S=draw(st.integers(1, 6), label="S"),
                        rest=draw(st.sampled_from([0, 1, 16, 200]), label="rest"))


def _run_partials(case: PartialsCase, device: str):
    parts = make_partials(case, device)
    c = case.route
    with expect_launch("route_topk_partials"):
        got = route_topk_partials(parts, c.E, c.k, normalize=c.normalize, dtype=c.dtype)
    ref_w, ref_ids, ref_rest = naive_route.route_topk_partials(parts.cpu(), c.E, c.k, c.normalize, c.dtype)
    weights, ids, rest = (t.cpu() for t in got)
    # the same fp32 sum in the same order, rounded once: the logits and the rest are the twin's bits
    assert rest.dtype == c.dtype and rest.shape == (c.R, case.rest)
    assert torch.equal(rest, ref_rest), "the columns past the experts differ from the twin's"
    cpu = parts.cpu()
    total = sum(cpu.unbind(0)[1:], cpu[0])  # s = 0, 1, ... in order, as the twin adds
    check_against_naive(c, total[:, : c.E].to(c.dtype), (weights, ids))


@settings(max_examples=20)
@given(case=partials_cases())
@example(case=PartialsCase(RouteCase(R=2, E=256, k=8, dtype=torch.bfloat16, normalize=True, data="normal", seed=0),
                           S=4, rest=16))
@example(case=PartialsCase(RouteCase(R=3, E=300, k=10, dtype=torch.float16, normalize=False, data="ties", seed=1),
                           S=3, rest=1))
@example(case=PartialsCase(RouteCase(R=1, E=1, k=1, dtype=torch.float32, normalize=True, data="normal", seed=2),
                           S=1, rest=0))
def test_partials_match_naive(device, case):
    _run_partials(case, device)


def test_partials_are_the_logits_op(device):
    """Summed and rounded in the kernel, partials route exactly as `route_topk` routes the rounded
    sum: the same ids and weights, bit for bit."""
    case = PartialsCase(RouteCase(R=5, E=64, k=8, dtype=torch.bfloat16, normalize=True, data="normal", seed=3),
                        S=4, rest=16)
    parts = make_partials(case, device)
    total = parts[0] + parts[1] + parts[2] + parts[3]
    weights, ids, rest = route_topk_partials(parts, 64, 8, dtype=torch.bfloat16)
    ref_w, ref_ids = route_topk(total[:, :64].to(torch.bfloat16).contiguous(), 8)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    assert torch.equal(rest, total[:, 64:].to(torch.bfloat16))


def test_partials_opcheck(device):
    case = PartialsCase(RouteCase(R=3, E=20, k=4, dtype=torch.float32, normalize=True, data="normal", seed=6), S=3, rest=5)
    parts = make_partials(case, device)
    op = torch.ops.hybridspec.route_topk_partials.default
    torch.library.opcheck(op, (parts, 20, 4, True, torch.float32))
    torch.library.opcheck(op, (parts, 20, 3, False, torch.bfloat16))
    torch.library.opcheck(op, (parts[:, :, :20].contiguous(), 20, 3, False, torch.bfloat16))


def test_partials_fullgraph_compile(device):
    case = PartialsCase(RouteCase(R=5, E=24, k=4, dtype=torch.float32, normalize=True, data="normal", seed=7), S=2, rest=3)
    parts = make_partials(case, device)

    def router_tail(parts):
        weights, ids, rest = route_topk_partials(parts * 2, 24, 4, dtype=torch.float32)
        # exact ops after the kernel: inductor's sigmoid may differ from eager's in the last bit
        return weights * 3, ids + 1, rest * 5

    assert_compiled_equal(router_tail, parts)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda p: (p[0], 20, 4), r"partials must be \[S, R, N\] with S, R, N >= 1, got \(3, 25\)"),
        (lambda p: (p[:0], 20, 4), r"partials must be \[S, R, N\] with S, R, N >= 1, got \(0, 3, 25\)"),
        (lambda p: (p.bfloat16(), 20, 4), "partials must be fp32, got torch.bfloat16"),
        (lambda p: (p.transpose(1, 2).contiguous().transpose(1, 2), 20, 4), "contiguous in their last dim"),
        (lambda p: (p, 26, 4), r"experts must be an int in 1..min\(N, 1024\) = 1..25, got 26"),
        (lambda p: (p, 0, 4), r"experts must be an int in 1..min\(N, 1024\) = 1..25, got 0"),
        (lambda p: (p, 20, 21), r"k must be an int with 1 <= k <= experts = 20, got 21"),
        (lambda p: (p, 20, 4, torch.float64), "dtype must be fp32, bf16 or fp16, got torch.float64"),
    ],
)
def test_partials_wrapper_validates(change, match):
    parts = torch.randn(2, 3, 25)
    parts = torch.cat([parts, parts[:1]])
    args = change(parts)
    kwargs = {"dtype": args[3]} if len(args) == 4 else {}
    with pytest.raises(ValueError, match=match):
        route_topk_partials(*args[:3], **kwargs)


# the block's fused router rows: E = 256 + the shared gate, padded to 272; Qwen3-Next: 512 + 16
GPU_PARTIAL_CASES = [
    PartialsCase(RouteCase(R=R, E=E, k=k, dtype=torch.bfloat16, normalize=True, data=data, seed=R + S), S=S, rest=16)
    for E, k in ((256, 8), (512, 10)) for R in (1, 16, 64) for S in (4, 8) for data in ("distinct", "normal")
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_PARTIAL_CASES,
                         ids=lambda c: f"S{c.S}-R{c.route.R}-E{c.route.E}-{c.route.data}")
def test_partials_real_shapes(case):
    _run_partials(case, "cuda")
