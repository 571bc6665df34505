"""router_topk (the MoE block's first GEMM and the router's selection in one launch) against its twin
(hybridspec.ops.naive_router: the two ops' twins composed), bit for bit against `small_linear`
followed by `route_topk`, and its counter left at 0 for the next launch (a CUDA graph's replay)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import naive_route, naive_router, route_topk, router_topk, small_linear
from hybridspec.ops.dispatch import TRITON_INTERPRET
from hybridspec.ops.router import fits, new_counter
from hybridspec.patches import common, family_of
from hybridspec.patches.fusion import fuse_model, unfuse_model
from hybridspec.tiny import tiny_next_target, tiny_target
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch
from tests.ops.test_linear import TOL as LINEAR_TOL
from tests.ops.test_route import TOL as ROUTE_TOL

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RouterCase:
    T: int
    E: int
    # the weight's rows: the router's E, then the fused linears' (N - E)
    N: int
    k: int
    H: int
    dtype: torch.dtype
    normalize: bool
    # "normal": Gaussian; "ties": experts in groups of identical weight rows and a coarse grid of
    # values, so logits tie exactly, at the k-th place too
    data: str
    seed: int
    # the weight as rows [w_off, w_off + N) of a wider buffer (the fused weight's rows after others)
    w_off: int = 0


def make_inputs(case: RouterCase, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, H]` and weight `[N, H]`; what of the weight's buffer lies outside it is NaN."""
    gen = torch.Generator().manual_seed(case.seed)
    T, E, N, H = case.T, case.E, case.N, case.H
    if case.data == "ties":
        x = torch.randint(-2, 3, (T, H), generator=gen).float()
        groups = torch.randint(-2, 3, (max(1, E // 3), H), generator=gen).float() / 8
        router = groups[torch.randint(0, len(groups), (E,), generator=gen)]
    else:
        x = torch.randn(T, H, generator=gen)
        router = torch.randn(E, H, generator=gen) * H**-0.5 * 3
    w = torch.full((case.w_off + N, H), float("nan"))
    w[case.w_off:case.w_off + E] = router
    w[case.w_off + E:] = torch.randn(N - E, H, generator=gen) * H**-0.5
    return x.to(case.dtype).to(device), w.to(case.dtype).to(device)[case.w_off:]


@st.composite
def router_cases(draw):
    E = draw(st.sampled_from([8, 64, 256]), label="E")
    return RouterCase(
        T=draw(st.integers(1, 16), label="T"),
        E=E,
        N=E + draw(st.sampled_from([0, 1, 1, 16, 40]), label="N - E"),
        k=draw(st.integers(1, 8), label="k"),
        H=draw(st.sampled_from([64, 128]), label="H"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        normalize=draw(st.booleans(), label="normalize"),
        data=draw(st.sampled_from(["normal", "ties"]), label="data"),
        seed=draw(st.integers(0, 2**16), label="seed"),
        w_off=draw(st.sampled_from([0, 0, 3]), label="w_off"),
    )


def _run(case: RouterCase, device: str, counter: torch.Tensor | None = None):
    x, w = make_inputs(case, device)
    counter = new_counter(device) if counter is None else counter
    with expect_launch("router_topk"):
        got = router_topk(x, w, case.E, case.k, counter, normalize=case.normalize)
    return x, w, counter, got


def check(case: RouterCase, x: torch.Tensor, w: torch.Tensor, got) -> None:
    """Against the twin: the logits within the GEMM's tolerance; the routing on the kernel's own
    logits as `route_topk`'s twin routes them (ties to the lowest index); and bit for bit against
    `small_linear` and `route_topk` on the same inputs."""
    logits, weights, ids = got
    T, E, N, k = case.T, case.E, case.N, case.k
    assert logits.shape == (T, N) and weights.shape == ids.shape == (T, k)
    assert logits.dtype == weights.dtype == case.dtype and ids.dtype == torch.long
    ref_logits, _, _ = naive_router.router_topk(x.cpu(), w.cpu(), E, k, case.normalize)
    assert_rel(logits.cpu(), ref_logits, LINEAR_TOL[case.dtype], "logits")
    own = logits.cpu()[:, :E]
    ref_w, ref_ids = naive_route.route_topk(own, k, case.normalize)
    probs = torch.softmax(own, dim=-1, dtype=torch.float32)
    # Gaussian fp32 logits may hold near-ties two softmaxes order differently: the probabilities
    # chosen must be the twin's, rank by rank
    torch.testing.assert_close(probs.gather(1, ids.cpu()), probs.gather(1, ref_ids), rtol=4e-6, atol=0)
    if case.data == "ties" or case.dtype != torch.float32:
        assert torch.equal(ids.cpu(), ref_ids), f"ids {ids.tolist()} != twin's {ref_ids.tolist()}"
    same = (ids.cpu() == ref_ids).all(dim=1)
    assert_rel(weights.cpu()[same], ref_w[same], ROUTE_TOL[case.dtype], "weights")
    with expect_launch("small_linear"), expect_launch("route_topk"):
        pair_logits = small_linear(x, w)
        pair_w, pair_ids = route_topk(pair_logits[:, :E], k, normalize=case.normalize)
    assert torch.equal(logits, pair_logits), "logits are not small_linear's bits"
    assert torch.equal(ids, pair_ids), "ids are not route_topk's"
    assert torch.equal(weights, pair_w), "weights are not route_topk's bits"


@settings(max_examples=16)
@given(case=router_cases())
@example(case=RouterCase(T=16, E=256, N=257, k=8, H=64, dtype=torch.bfloat16, normalize=True, data="normal", seed=0))
@example(case=RouterCase(T=5, E=64, N=65, k=8, H=128, dtype=torch.float32, normalize=False, data="ties", seed=1,
                         w_off=3))
@example(case=RouterCase(T=1, E=8, N=8, k=1, H=64, dtype=torch.float16, normalize=True, data="ties", seed=2))
def test_matches_twin_and_the_two_ops(device, case):
    x, w, counter, got = _run(case, device)
    check(case, x, w, got)
    assert counter.item() == 0, "the counter must be left at 0 for the next launch"


@pytest.mark.parametrize("E, k", [(300, 8), (1024, 10)])
def test_wide_routers(device, E, k):
    """E padded past a power of two (300 -> 512 lanes), and the widest router: the last program
    routes its rows in blocks (4 rows of 1024 lanes at a time)."""
    case = RouterCase(T=9, E=E, N=E + 1, k=k, H=64, dtype=torch.bfloat16, normalize=True, data="ties", seed=E)
    x, w, counter, got = _run(case, device)
    check(case, x, w, got)


def test_counter_repeats(device):
    """Launches of other widths and rows back to back on one counter, as the block's layers and a
    graph's replays run: each finds it at 0 and leaves it so; the same inputs give the same bits."""
    counter = new_counter(device)
    cases = [RouterCase(T=T, E=E, N=N, k=4, H=64, dtype=torch.bfloat16, normalize=True, data="normal", seed=T)
             for T, E, N in [(3, 64, 65), (16, 64, 272), (1, 8, 9)]]
    for case in cases + cases[:1]:
        x, w, counter, got = _run(case, device, counter)
        assert counter.item() == 0
        again = router_topk(x, w, case.E, case.k, counter)
        assert all(torch.equal(a, b) for a, b in zip(got, again))
        assert counter.item() == 0


def test_opcheck(device):
    case = RouterCase(T=3, E=20, N=24, k=4, H=16, dtype=torch.float32, normalize=True, data="normal", seed=6)
    x, w = make_inputs(case, device)
    counter = new_counter(device)
    op = torch.ops.hybridspec.router_topk.default
    torch.library.opcheck(op, (x, w, counter, 20, 4, True))
    torch.library.opcheck(op, (x.bfloat16(), w.bfloat16(), counter, 20, 3, False))


def test_fullgraph_compile(device):
    case = RouterCase(T=5, E=16, N=17, k=4, H=16, dtype=torch.float32, normalize=True, data="normal", seed=7)
    x, w = make_inputs(case, device)
    counter = new_counter(device)

    def block(x, w, counter):
        logits, weights, ids = router_topk(x * 2, w, 16, 4, counter)
        return torch.sigmoid(logits[:, 16:]) * weights.sum(-1, keepdim=True), ids + 1

    eager = block(x, w, counter)
    compiled = torch.compile(block, fullgraph=True)(x, w, counter)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)
    assert counter.item() == 0


def test_fits():
    x, w = make_inputs(RouterCase(T=4, E=8, N=9, k=2, H=16, dtype=torch.bfloat16, normalize=True, data="normal",
                                  seed=8), "cpu")
    from hybridspec.ops.dispatch import use_triton

    assert fits(x, w, 8) == use_triton(x)
    assert not fits(torch.zeros(17, 16, dtype=x.dtype), w, 8), "17 rows"
    assert not fits(x, w, 10) and not fits(x, w, 0), "more experts than weight rows, or none"
    assert not fits(x.float(), w, 8), "dtypes differ"


def _inputs():
    x, w = make_inputs(RouterCase(T=3, E=20, N=24, k=4, H=16, dtype=torch.float32, normalize=True, data="normal",
                                  seed=9), "cpu")
    return x, w, 20, 4, new_counter("cpu")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x, w, E, k, c: (x[0], w, E, k, c), r"x must be \[M, K\] with 1 <= M <= 16 and K >= 1, got \(16,\)"),
        (lambda x, w, E, k, c: (x.new_zeros(17, 16), w, E, k, c), r"1 <= M <= 16 and K >= 1, got \(17, 16\)"),
        (lambda x, w, E, k, c: (x, w[:, :8], E, k, c),
         r"weight must be \[N, K\] = \[N, 16\] with N >= 1, got \(24, 8\)"),
        (lambda x, w, E, k, c: (x.double(), w.double(), E, k, c), "x must be fp32, bf16 or fp16, got torch.float64"),
        (lambda x, w, E, k, c: (x, w.bfloat16(), E, k, c),
         r"weight \(torch.bfloat16\) must have x's dtype torch.float32"),
        (lambda x, w, E, k, c: (x.t().contiguous().t(), w, E, k, c),
         r"contiguous in their last dim, got strides \(1, 3\)"),
        (lambda x, w, E, k, c: (x, w, 25, k, c),
         r"num_experts must be an int with 1 <= num_experts <= min\(N, 1024\) = 24 for weight \(24, 16\), got 25"),
        (lambda x, w, E, k, c: (x, w, 0, k, c), r"1 <= num_experts <= min\(N, 1024\) = 24 .* got 0"),
        (lambda x, w, E, k, c: (x, w, E, 21, c), r"k must be an int with 1 <= k <= num_experts = 20, got 21"),
        (lambda x, w, E, k, c: (x, w, E, 2.0, c), r"k must be an int with 1 <= k <= num_experts = 20, got 2.0"),
        (lambda x, w, E, k, c: (x, w, E, k, c.long()),
         r"counter must be an int32 tensor of shape \[1\] \(new_counter\), got torch.int64 \(1,\)"),
        (lambda x, w, E, k, c: (x, w, E, k, c.new_zeros(2)), r"counter must be an int32 tensor of shape \[1\]"),
        (lambda x, w, E, k, c: (x, w, E, k, c.to("meta")), r"counter is on meta, x on cpu"),
    ],
)
def test_wrapper_validates(change, match):
    with pytest.raises(ValueError, match=match):
        router_topk(*change(*_inputs()))


# the block's rows: a verification window of 5 in two batch rows, and 18 rows (past the op's 16)
@pytest.mark.parametrize("rows", [(2, 5), (2, 9)], ids=["10 rows", "18 rows"])
@pytest.mark.parametrize("build", ["qwen3.5", "qwen3.5 bf16", "qwen3-next, not renormalising",
                                   "qwen3.5, wider shared expert"])
def test_moe_block_takes_it(monkeypatch, build, rows):
    """The MoE block with our kernels' path taken (on the CPU under the interpreter, standing in for
    CUDA): on a fused block `moe_verify` and Stage 0's `route` run the GEMM and the router's tail as
    one `router_topk` launch, with the bits the block had before (`small_linear`, `route_topk`);
    past 16 rows, or unfused, the block keeps the two ops."""
    if not TRITON_INTERPRET:
        pytest.skip("the kernels' path on the CPU needs TRITON_INTERPRET=1")
    monkeypatch.setattr(common, "_kernels_on", lambda t: True)
    dtype = torch.bfloat16 if "bf16" in build else torch.float32
    model = (tiny_next_target if "next" in build else tiny_target)(seed=3, dtype=dtype)
    family = family_of(model)
    mlp = family.text_model(model).layers[1].mlp
    if "not renormalising" in build:
        mlp.gate.norm_topk_prob = False
    if "wider" in build:
        # not of the routed experts' width: the fused GEMM computes the shared expert's projections too
        shared = mlp.shared_expert
        shared.gate_proj, shared.up_proj = (torch.nn.Linear(64, 48, bias=False, dtype=dtype) for _ in range(2))
        shared.down_proj = torch.nn.Linear(48, 64, bias=False, dtype=dtype)
    fuse_model(family, model)
    counter = getattr(mlp, common.ROUTER_COUNTER)
    assert counter.tolist() == [0] and common.ROUTER_COUNTER not in mlp.state_dict()
    x = (torch.randn(*rows, 64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    fused = rows[0] * rows[1] <= 16

    def block():
        routing = []
        with torch.no_grad():
            out = common.moe_verify(family, mlp, x, routing)
            stage0 = common.route(family, mlp, x)
        return out, routing[0], stage0

    with expect_launch("router_topk", 2 if fused else 0), expect_launch("route_topk", 0 if fused else 2):
        out, ids, (stage0_ids, stage0_weights) = block()
    assert counter.tolist() == [0]
    fused_route = common.fused_route
    monkeypatch.setattr(common, "fused_route", lambda *args: None)
    launches = (expect_launch("router_topk", 0), expect_launch("route_topk", 2),
                expect_launch("small_linear", 2 + ("wider" in build)))
    with launches[0], launches[1], launches[2]:
        ref_out, ref_ids, (ref_stage0_ids, ref_stage0_weights) = block()
    assert torch.equal(ids, ref_ids) and torch.equal(stage0_ids, ids), "other experts"
    assert torch.equal(stage0_weights, ref_stage0_weights), "other routing weights"
    assert torch.equal(out, ref_out), "another block output"
    unfuse_model(family, model)
    assert not hasattr(mlp, common.ROUTER_COUNTER)
    monkeypatch.setattr(common, "fused_route", fused_route)
    with expect_launch("router_topk", 0), expect_launch("route_topk", 2):
        _, unfused_ids, (unfused_stage0_ids, _) = block()
    assert torch.equal(unfused_ids, ids) and torch.equal(unfused_stage0_ids, ids)


# the 35B-A3B / 122B-A10B block (E = 256, k = 8, the shared expert's gate and padding: 272 rows) and
# Qwen3-Next's router (E = 512, k = 10), at H = 2048, one to sixteen rows
GPU_CASES = [
    RouterCase(T=T, E=E, N=N, k=k, H=2048, dtype=dtype, normalize=True, data=data, seed=T + E)
    for E, N, k in ((256, 272, 8), (512, 528, 10)) for T in (1, 4, 16) for dtype in (torch.bfloat16, torch.float32)
    for data in ("normal", "ties")
] + [RouterCase(T=8, E=512, N=1296, k=10, H=2048, dtype=torch.bfloat16, normalize=False, data="normal", seed=3)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda c: f"T{c.T}-E{c.E}-N{c.N}-{c.dtype}-{c.data}-n{int(c.normalize)}")
def test_real_shapes(case):
    x, w, counter, got = _run(case, "cuda")
    check(case, x, w, got)
    assert counter.item() == 0


@pytest.mark.gpu
def test_cuda_graph_replays():
    """Captured once, replayed on new inputs: each replay finds the counter at 0 (the last program
    of the previous one reset it) and gives `small_linear` + `route_topk`'s bits."""
    case = RouterCase(T=4, E=256, N=272, k=8, H=2048, dtype=torch.bfloat16, normalize=True, data="normal", seed=11)
    x, w = make_inputs(case, "cuda")
    counter = new_counter("cuda")
    router_topk(x, w, case.E, case.k, counter)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = router_topk(x, w, case.E, case.k, counter)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(5):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert counter.item() == 0
        pair_logits = small_linear(x, w)
        pair_w, pair_ids = route_topk(pair_logits[:, :case.E], case.k)
        for got, ref in zip(outs, (pair_logits, pair_w, pair_ids)):
            assert torch.equal(got, ref)
