"""moe_experts_partials against its twin (hybridspec.ops.naive_moe) and, through moe_combine, against
moe_experts: the same block with the reduce left to the consumer."""

import contextlib
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import moe_combine, moe_experts, moe_experts_partials, naive_moe
from hybridspec.ops.moe import piece_rows
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch
from tests.ops.moe_inputs import ROUTINGS, MoECase, make_inputs, make_shared, moe_cases

# fp32 products and sums in both; bf16: the SwiGLU rounding flips now and then with summation order
Y_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


@contextlib.contextmanager
def expect_two_launches(T: int):
    """Gate/up and down once per piece, and no reduce."""
    pieces = math.ceil(T / piece_rows(T))
    with expect_launch("moe_gate_up", pieces), expect_launch("moe_down", pieces), expect_launch("moe_reduce", 0), \
            expect_launch("moe_experts_partials", 1):
        yield


def _valid(case: MoECase, ids: torch.Tensor) -> torch.Tensor:
    """[T, k]: the assignments that give an expert output."""
    n = case.T if case.n is None else case.n
    return (torch.arange(case.T)[:, None] < n) & (ids.cpu() >= 0) & (ids.cpu() < case.E)


@settings(max_examples=12)
@given(case=moe_cases(max_tokens=20))
@example(case=MoECase(T=1, K=8, E=16, H=64, I=32, dtype=torch.bfloat16, routing="random", n=None, seed=3))
@example(case=MoECase(T=16, K=8, E=12, H=48, I=16, dtype=torch.float32, routing="repeat", n=11, seed=4))
@example(case=MoECase(T=5, K=2, E=6, H=32, I=16, dtype=torch.float32, routing="shared", n=0, seed=7))
def test_matches_naive(device, case):
    """Every slot written (the op's output is NaN-poisoned first): the experts' outputs where the
    assignment is valid, the shared expert's in the last slot, zeros elsewhere, as the twin has them."""
    hidden, ids, wts, gate_up, down, nt = make_inputs(case, device)
    s_gate_up, s_down, _ = make_shared(case, device)
    for shared in (None, (s_gate_up, s_down)):
        with expect_two_launches(case.T):
            y = moe_experts_partials(hidden, ids, gate_up, down, num_tokens=nt, shared=shared)
        args = (hidden, ids, gate_up, down, nt, *(shared or ()))
        ref = naive_moe.moe_experts_partials(*(None if a is None else a.cpu() for a in args))
        K = case.K + (shared is not None)
        assert y.dtype == torch.float32 and y.shape == (case.T, K, case.H)
        assert not torch.isnan(y).any(), "a slot of y was left unwritten"
        assert_rel(y.cpu(), ref, Y_TOL[case.dtype], "y vs naive")
        invalid = ~_valid(case, ids)
        assert torch.equal(y.cpu()[:, : case.K][invalid], torch.zeros_like(ref[:, : case.K][invalid]))
        if shared is not None and case.n is not None:
            assert torch.equal(y.cpu()[case.n :, -1], torch.zeros_like(y.cpu()[case.n :, -1]))


# up to 16 rows: the gathered pieces past 16 rows are test_batched_piece_matches_naive's, both ops
@settings(max_examples=10)
@given(case=moe_cases(max_tokens=16))
@example(case=MoECase(T=1, K=8, E=16, H=64, I=32, dtype=torch.bfloat16, routing="random", n=None, seed=3))
@example(case=MoECase(T=16, K=8, E=12, H=48, I=16, dtype=torch.bfloat16, routing="repeat", n=11, seed=4))
def test_combined_is_moe_experts(device, case):
    """`moe_combine` of the partials is `moe_experts`' block, with and without the shared expert;
    rows past num_tokens (NaN weights and gates there) are zero."""
    hidden, ids, wts, gate_up, down, nt = make_inputs(case, device)
    s_gate_up, s_down, logits = make_shared(case, device)
    for shared in (False, True):
        y = moe_experts_partials(hidden, ids, gate_up, down, num_tokens=nt, shared=(s_gate_up, s_down) if shared else None)
        got = moe_combine(y, ids, wts, case.E, case.dtype, num_tokens=nt, shared_gate=logits if shared else None)
        want = moe_experts(hidden, ids, wts, gate_up, down, num_tokens=nt,
                           shared=(s_gate_up, s_down, logits) if shared else None)
        assert got.dtype == case.dtype and got.shape == (case.T, case.H)
        # fp32: the same terms in the same order; bf16: the roundings may land on the other side
        assert_rel(got.cpu().float(), want.cpu().float(), 1e-6 if case.dtype == torch.float32 else 8e-3, "combined")
        if case.n is not None:
            assert torch.equal(got[case.n :].cpu(), torch.zeros_like(got[case.n :].cpu()))


@pytest.mark.parametrize("T, K, n", [(21, 2, None), (70, 2, 66), (70, 1, 40)])
def test_pieces(device, T, K, n):
    """Past 64 rows each piece writes its own rows of y; a piece with no counted row (n = 40: the
    second) gets its zeros from the gate/up grid, the shared slot's included."""
    case = MoECase(T=T, K=K, E=6, H=32, I=16, dtype=torch.float32, routing="random", n=n, seed=T)
    hidden, ids, wts, gate_up, down, nt = make_inputs(case, device)
    shared = make_shared(case, device)[:2]
    with expect_two_launches(T):
        y = moe_experts_partials(hidden, ids, gate_up, down, num_tokens=nt, shared=shared)
    ref = naive_moe.moe_experts_partials(*(None if a is None else a.cpu() for a in (hidden, ids, gate_up, down, nt, *shared)))
    assert_rel(y.cpu(), ref, 1e-5, "y vs naive")


@st.composite
def batched_cases(draw):
    """A batched round's piece: B sequences of w rows flattened (B * w in 17..64 rows: the gathered
    tiles), each sequence counting its first `counts[b]` rows and the rest carrying id -1, as
    `patches.common` marks them; "one_expert" and "shared" routings give an expert more than 16 rows."""
    B = draw(st.integers(2, 4), label="B")
    w = draw(st.integers(-(-17 // B), 16), label="w")
    counts = draw(st.lists(st.integers(0, w), min_size=B, max_size=B), label="counts")
    # k = 1 or 2 keeps the interpreter's slot grid small; top-8 at 64 rows runs in the GPU cases
    case = MoECase(T=B * w, K=draw(st.sampled_from([1, 2]), label="k"), E=draw(st.integers(8, 16), label="E"), H=32,
                   I=draw(st.sampled_from([16, 32]), label="I"), dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                   routing=draw(st.sampled_from(ROUTINGS), label="routing"), n=None, seed=draw(st.integers(0, 2**31 - 1)))
    return case, w, counts


@settings(max_examples=3, deadline=None)
@given(arg=batched_cases())
@example(arg=(MoECase(T=64, K=2, E=12, H=32, I=16, dtype=torch.float32, routing="one_expert", n=None, seed=5), 16,
              [16, 3, 16, 0]))
def test_batched_piece_matches_naive(device, arg):
    """Past 16 rows (GATHER) each routed expert's rows are gathered into 16-row tiles and the shared
    expert keeps the piece's tile: the twin's y for every slot, zeros at the padding rows' ids."""
    case, w, counts = arg
    assert piece_rows(case.T) > 16
    hidden, ids, wts, gate_up, down, _ = make_inputs(case, device)
    counted = (torch.arange(w)[None, :] < torch.tensor(counts)[:, None]).reshape(-1).to(device)  # [B * w]
    ids = torch.where(counted[:, None], ids, -1)
    s_gate_up, s_down, logits = make_shared(case, device)
    for shared in (None, (s_gate_up, s_down)):
        with expect_two_launches(case.T):
            y = moe_experts_partials(hidden, ids, gate_up, down, shared=shared)
        args = (hidden, ids, gate_up, down, None, *(shared or ()))
        ref = naive_moe.moe_experts_partials(*(None if a is None else a.cpu() for a in args))
        assert not torch.isnan(y).any(), "a slot of y was left unwritten"
        assert_rel(y.cpu(), ref, Y_TOL[case.dtype], "y vs naive")
        assert torch.equal(y.cpu()[:, : case.K][~counted.cpu()], torch.zeros_like(ref[:, : case.K][~counted.cpu()]))
    out = moe_experts(hidden, ids, wts, gate_up, down, shared=(s_gate_up, s_down, logits))
    ref = naive_moe.moe_experts(*(a.cpu() for a in (hidden, ids, wts, gate_up, down)), None,
                                *(a.cpu() for a in (s_gate_up, s_down, logits)))
    assert_rel(out.cpu().float(), ref.float(), Y_TOL[case.dtype], "moe_experts vs naive")


def test_combine_order_and_masks():
    """The routed terms in the order j = 0..k-1 (fp32 addition is not associative), and NaN
    weights of invalid assignments selected away rather than multiplied by zero."""
    y = torch.tensor([[[1e8], [1.0], [-1e8]]])  # [T = 1, k = 3, H = 1]
    ids = torch.tensor([[0, 1, 2]])
    w = torch.ones(1, 3)
    # in fp32 (1e8 + 1) - 1e8 is 0, where (1e8 - 1e8) + 1, another order, is 1
    assert moe_combine(y, ids, w, 3, torch.float32).item() == ((y[0, 0] + y[0, 1]) + y[0, 2]).item() == 0.0
    w_nan = torch.tensor([[1.0, float("nan"), 1.0]])
    assert moe_combine(y, torch.tensor([[0, 3, 2]]), w_nan, 3, torch.float32).item() == 0.0
    rows = moe_combine(torch.ones(2, 3, 1), ids.repeat(2, 1), torch.tensor([[1.0, 1, 1], [float("nan")] * 3]), 3,
                       torch.float32, num_tokens=torch.tensor([1]))
    assert rows.tolist() == [[3.0], [0.0]]


def test_combine_validates():
    y = torch.zeros(2, 3, 4)
    ids, w = torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)
    with pytest.raises(ValueError, match="y has 3 slots a row: k = 2 routed make 2"):
        moe_combine(y, ids, w, 4, torch.float32)
    with pytest.raises(ValueError, match=r"y must be moe_experts_partials' \[T, k \(\+1\), H\] fp32"):
        moe_combine(y.double(), ids, w, 4, torch.float32, shared_gate=torch.zeros(2))
    with pytest.raises(ValueError, match="topk_weights must be a float"):
        moe_combine(y, ids, w[:, :1], 4, torch.float32, shared_gate=torch.zeros(2))
    with pytest.raises(ValueError, match=r"shared_gate must be \[T\] or \[T, 1\]"):
        moe_combine(y, ids, w, 4, torch.float32, shared_gate=torch.zeros(3))


def _small_args(device):
    case = MoECase(T=3, K=2, E=4, H=32, I=16, dtype=torch.float32, routing="shared", n=2, seed=5)
    hidden, ids, _, gate_up, down, nt = make_inputs(case, device)
    return case, (hidden, ids, gate_up, down, nt)


def test_opcheck(device):
    case, args = _small_args(device)
    torch.library.opcheck(torch.ops.hybridspec.moe_experts_partials.default, args)
    shared = make_shared(case, device)[:2]
    torch.library.opcheck(torch.ops.hybridspec.moe_experts_partials.default, (*args, *shared))
    torch.library.opcheck(torch.ops.hybridspec.moe_experts_partials.default, (*(a[:2] for a in args[:2]), *args[2:4], None))


def test_fullgraph_compile(device):
    """The partials and their combine in one compiled region (no graph break), with the residual
    add after them, as a compiled decoder layer runs them: the eager result."""
    case, (hidden, ids, gate_up, down, nt) = _small_args(device)
    s_gate_up, s_down, logits = make_shared(case, device)
    wts = torch.rand(case.T, case.K, generator=torch.Generator().manual_seed(1)).to(device)

    def block(residual, hidden, ids, wts, gate_up, down, nt, s_gate_up, s_down, logits):
        y = moe_experts_partials(hidden, ids, gate_up, down, num_tokens=nt, shared=(s_gate_up, s_down))
        return residual + moe_combine(y, ids, wts, gate_up.shape[0], hidden.dtype, num_tokens=nt, shared_gate=logits)

    args = (torch.randn(case.T, case.H).to(device), hidden.nan_to_num(), ids, wts, gate_up, down, nt, s_gate_up,
            s_down, logits)
    eager = block(*args)
    compiled = torch.compile(block, fullgraph=True)(*args)
    assert_rel(compiled.cpu(), eager.cpu(), 1e-6, "compiled vs eager")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "down_proj": a["down_proj"][:, :, :8]}, r"down_proj must be \[E, H, I\] = \[4, 32, 16\]"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "topk_ids must be an integer tensor"),
        (lambda a: {**a, "shared": (torch.zeros(32, 32), torch.zeros(32, 16), torch.zeros(3))},
         r"shared must be \(gate_up, down\) here"),
        (lambda a: {**a, "shared": (torch.zeros(16, 32), torch.zeros(32, 16))},
         r"the shared expert must have the routed experts' sizes"),
    ],
)
def test_wrapper_validates(change, match):
    _, (hidden, ids, gate_up, down, nt) = _small_args("cpu")
    args = change(dict(hidden=hidden, topk_ids=ids, gate_up_proj=gate_up, down_proj=down, num_tokens=nt))
    with pytest.raises(ValueError, match=match):
        moe_experts_partials(args.pop("hidden"), args.pop("topk_ids"), args.pop("gate_up_proj"), args.pop("down_proj"),
                             **args)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, E", [(1, 256), (16, 256), (64, 512)])
def test_real_shapes(rows, E):
    """The 35B-A3B / Qwen3-Next expert shapes in bf16 (H 2048, I 512, top-8 and the shared expert)."""
    gen = torch.Generator().manual_seed(rows)
    H, I, K = 2048, 512, 8
    hidden = torch.randn(rows, H, generator=gen).bfloat16().cuda()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(rows)]).cuda()
    wts = torch.rand(rows, K, generator=gen).bfloat16().cuda()
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).bfloat16().cuda()
    down = (torch.randn(E, H, I, generator=gen) * I**-0.5).bfloat16().cuda()
    s_gate_up, s_down = gate_up[0].clone(), down[0].clone()
    logits = torch.randn(rows, 1, generator=gen).bfloat16().cuda()
    y = moe_experts_partials(hidden, ids, gate_up, down, shared=(s_gate_up, s_down))
    got = moe_combine(y, ids, wts, E, torch.bfloat16, shared_gate=logits)
    want = moe_experts(hidden, ids, wts, gate_up, down, shared=(s_gate_up, s_down, logits))
    assert_rel(got.float(), want.float(), 8e-3, "combined vs moe_experts")
