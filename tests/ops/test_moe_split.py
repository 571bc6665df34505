"""moe_experts_split_partials against its twin (hybridspec.ops.naive_moe) and, added up by
moe_combine, against moe_experts: the decode step's experts in one launch, split over I."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import moe_combine, moe_experts, moe_experts_partials, moe_experts_split_partials, naive_moe
from hybridspec.ops.moe_split import default_splits
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch
from tests.ops.moe_inputs import MoECase, make_inputs, make_shared, moe_cases

# fp32 products and sums in both; bf16: the SwiGLU rounding flips now and then with summation order
Y_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


@settings(max_examples=12, deadline=None)
@given(case=moe_cases(max_tokens=16), finest=st.booleans())
@example(case=MoECase(T=1, K=8, E=16, H=64, I=32, dtype=torch.bfloat16, routing="random", n=None, seed=3), finest=True)
@example(case=MoECase(T=16, K=8, E=12, H=48, I=48, dtype=torch.float32, routing="repeat", n=11, seed=4), finest=False)
@example(case=MoECase(T=5, K=2, E=6, H=32, I=16, dtype=torch.float32, routing="shared", n=0, seed=7), finest=False)
def test_matches_naive(device, case, finest):
    """Every slot and split written (the output is checked for NaN: nothing left unwritten): the
    experts' split outputs where the assignment is valid, the shared expert's in the last slot,
    zeros elsewhere, as the twin has them; one launch."""
    hidden, ids, wts, gate_up, down, nt = make_inputs(case, device)
    s_gate_up, s_down, _ = make_shared(case, device)
    # 16-column slices (I // 16 splits) where that is a power of two, else the default
    splits = case.I // 16 if finest and case.I in (16, 32) else default_splits(case.I)
    for shared in (None, (s_gate_up, s_down)):
        with expect_launch("moe_split", 1), expect_launch("moe_gate_up", 0), expect_launch("moe_down", 0):
            y = moe_experts_split_partials(hidden, ids, gate_up, down, num_tokens=nt, shared=shared, splits=splits)
        args = (hidden, ids, gate_up, down, nt)
        ref = naive_moe.moe_experts_split_partials(*(None if a is None else a.cpu() for a in args), splits,
                                                   *(() if shared is None else (a.cpu() for a in shared)))
        K = case.K + (shared is not None)
        assert y.dtype == torch.float32 and y.shape == (case.T, K, splits, case.H)
        assert not torch.isnan(y).any(), "a slot of y was left unwritten"
        assert_rel(y.cpu(), ref, Y_TOL[case.dtype], "y vs naive")
        rows = case.T if case.n is None else case.n
        invalid = ~((torch.arange(case.T)[:, None] < rows) & (ids.cpu() >= 0) & (ids.cpu() < case.E))
        assert torch.equal(y.cpu()[:, : case.K][invalid], torch.zeros_like(ref[:, : case.K][invalid]))
        if shared is not None and case.n is not None:
            assert torch.equal(y.cpu()[case.n :, -1], torch.zeros_like(y.cpu()[case.n :, -1]))


@settings(max_examples=10, deadline=None)
@given(case=moe_cases(max_tokens=16))
@example(case=MoECase(T=1, K=8, E=16, H=64, I=32, dtype=torch.bfloat16, routing="random", n=None, seed=3))
@example(case=MoECase(T=4, K=8, E=12, H=48, I=48, dtype=torch.float32, routing="repeat", n=3, seed=4))
def test_combined_is_moe_experts(device, case):
    """`moe_combine` of the split partials is `moe_experts`' block and the unsplit partials' sum,
    with and without the shared expert; rows past num_tokens (NaN weights and gates) are zero."""
    hidden, ids, wts, gate_up, down, nt = make_inputs(case, device)
    s_gate_up, s_down, logits = make_shared(case, device)
    for shared in (False, True):
        pair = (s_gate_up, s_down) if shared else None
        y = moe_experts_split_partials(hidden, ids, gate_up, down, num_tokens=nt, shared=pair)
        got = moe_combine(y, ids, wts, case.E, case.dtype, num_tokens=nt, shared_gate=logits if shared else None)
        want = moe_experts(hidden, ids, wts, gate_up, down, num_tokens=nt,
                           shared=(s_gate_up, s_down, logits) if shared else None)
        assert got.dtype == case.dtype and got.shape == (case.T, case.H)
        # fp32: the same terms, the sum over I in another order; bf16: roundings may land elsewhere
        tol = 1e-5 if case.dtype == torch.float32 else 8e-3
        assert_rel(got.cpu().float(), want.cpu().float(), tol, "combined vs moe_experts")
        unsplit = moe_experts_partials(hidden, ids, gate_up, down, num_tokens=nt, shared=pair)
        assert_rel(y.sum(2).cpu(), unsplit.cpu(), Y_TOL[case.dtype], "split sum vs unsplit partials")
        if case.n is not None:
            assert torch.equal(got[case.n :].cpu(), torch.zeros_like(got[case.n :].cpu()))


def test_combine_adds_the_splits_in_order():
    """The splits of I are added b = 0..splits-1 before the weighted sum over j (fp32 addition is
    not associative: another order gives another result here)."""
    y = torch.tensor([[[[1e8], [1.0], [-1e8]]]])  # [T = 1, k = 1, splits = 3, H = 1]
    ids, w = torch.tensor([[0]]), torch.ones(1, 1)
    assert moe_combine(y, ids, w, 1, torch.float32).item() == ((y[0, 0, 0] + y[0, 0, 1]) + y[0, 0, 2]).item() == 0.0


def _small_args(device):
    case = MoECase(T=3, K=2, E=4, H=32, I=32, dtype=torch.float32, routing="shared", n=2, seed=5)
    hidden, ids, _, gate_up, down, nt = make_inputs(case, device)
    return case, (hidden, ids, gate_up, down, nt)


def test_opcheck(device):
    case, args = _small_args(device)
    op = torch.ops.hybridspec.moe_experts_split_partials.default
    torch.library.opcheck(op, (*args, 2))
    torch.library.opcheck(op, (*args, 1, *make_shared(case, device)[:2]))
    torch.library.opcheck(op, (*(a[:2] for a in args[:2]), *args[2:4], None, 2))


def test_fullgraph_compile(device):
    """The split partials and their combine in one compiled region (no graph break), with the
    residual add after them, as a compiled decoder layer runs them: the eager result."""
    case, (hidden, ids, gate_up, down, nt) = _small_args(device)
    s_gate_up, s_down, logits = make_shared(case, device)
    wts = torch.rand(case.T, case.K, generator=torch.Generator().manual_seed(1)).to(device)

    def block(residual, hidden, ids, wts, gate_up, down, nt, s_gate_up, s_down, logits):
        y = moe_experts_split_partials(hidden, ids, gate_up, down, num_tokens=nt, shared=(s_gate_up, s_down), splits=2)
        return residual + moe_combine(y, ids, wts, gate_up.shape[0], hidden.dtype, num_tokens=nt, shared_gate=logits)

    args = (torch.randn(case.T, case.H).to(device), hidden.nan_to_num(), ids, wts, gate_up, down, nt, s_gate_up,
            s_down, logits)
    eager = block(*args)
    compiled = torch.compile(block, fullgraph=True)(*args)
    assert_rel(compiled.cpu(), eager.cpu(), 1e-6, "compiled vs eager")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "splits": 3}, r"splits must divide I = 32 into slices of a power of two >= 16"),
        (lambda a: {**a, "splits": 4}, r"splits must divide I = 32 into slices of a power of two >= 16"),
        (lambda a: {**a, "hidden": a["hidden"].repeat(6, 1), "topk_ids": a["topk_ids"].repeat(6, 1)},
         "at most 16 rows, got 18"),
        (lambda a: {**a, "down_proj": a["down_proj"][:, :, :16]}, r"down_proj must be \[E, H, I\] = \[4, 32, 32\]"),
        (lambda a: {**a, "shared": (torch.zeros(64, 32), torch.zeros(32, 32), torch.zeros(3))},
         r"shared must be \(gate_up, down\) here"),
    ],
)
def test_wrapper_validates(change, match):
    _, (hidden, ids, gate_up, down, nt) = _small_args("cpu")
    args = change(dict(hidden=hidden, topk_ids=ids, gate_up_proj=gate_up, down_proj=down, num_tokens=nt))
    with pytest.raises(ValueError, match=match):
        moe_experts_split_partials(args.pop("hidden"), args.pop("topk_ids"), args.pop("gate_up_proj"),
                                   args.pop("down_proj"), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, E", [(1, 256), (4, 256), (16, 512)])
def test_real_shapes(rows, E):
    """The 35B-A3B / Qwen3-Next expert shapes in bf16 (H 2048, I 512, top-8 and the shared
    expert), at the default splits: the combined block is `moe_experts`'."""
    gen = torch.Generator().manual_seed(rows)
    H, I, K = 2048, 512, 8
    hidden = torch.randn(rows, H, generator=gen).bfloat16().cuda()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(rows)]).cuda()
    wts = torch.rand(rows, K, generator=gen).bfloat16().cuda()
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).bfloat16().cuda()
    down = (torch.randn(E, H, I, generator=gen) * I**-0.5).bfloat16().cuda()
    s_gate_up, s_down = gate_up[0].clone(), down[0].clone()
    logits = torch.randn(rows, 1, generator=gen).bfloat16().cuda()
    y = moe_experts_split_partials(hidden, ids, gate_up, down, shared=(s_gate_up, s_down))
    assert y.shape == (rows, K + 1, default_splits(I), H)
    got = moe_combine(y, ids, wts, E, torch.bfloat16, shared_gate=logits)
    want = moe_experts(hidden, ids, wts, gate_up, down, shared=(s_gate_up, s_down, logits))
    assert_rel(got.float(), want.float(), 8e-3, "combined vs moe_experts")
