"""GDN verify/commit kernels against the token-by-token recurrence (hybridspec.ops.naive)."""

import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import GDNFactors, gdn_commit, gdn_verify, gdn_verify_packed, naive
from hybridspec.ops import gdn as gdn_mod
from hybridspec.ops.gdn import verify_block_v, verify_block_v_one_row
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch
from tests.ops.gdn_inputs import GDNCase, gdn_cases, make_inputs

STATE_TOL = 1e-5
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def _lengths(data, B, T):
    n = data.draw(st.lists(st.integers(1, T), min_size=B, max_size=B), label="num_tokens")
    m = [data.draw(st.integers(0, x), label="num_commit") for x in n]
    return n, m


def _check_round(case: GDNCase, device: str, n: list[int] | None, m: list[int]):
    q, k, v, g, beta, state = make_inputs(case, device)
    nt = None if n is None else torch.tensor(n, device=device, dtype=torch.int32)
    with expect_launch("gdn_verify"):
        o, f = gdn_verify(q, k, v, g, beta, state, num_tokens=nt)
    # the oracle sees the same bf16-rounded inputs, upcast to fp32
    ref_o, ref_z, ref_k, ref_g, ref_states = naive.recurrent_states(
        *(x.float().cpu() for x in (q, k, v, g, beta, state)), num_tokens=None if nt is None else nt.cpu()
    )
    assert o.dtype == v.dtype
    assert_rel(o.float().cpu(), ref_o, OUT_TOL[case.dtype], "o")
    assert_rel(f.z.cpu(), ref_z, STATE_TOL, "z")
    assert_rel(f.k.cpu(), ref_k, STATE_TOL, "k")
    assert_rel(f.g_cum.cpu(), ref_g, STATE_TOL, "g_cum")

    states = state[None].clone()
    with expect_launch("gdn_commit"):
        gdn_commit(states, GDNFactors(*(x[None] for x in f)), torch.tensor(m, device=device))
    expected = torch.stack(
        [state[b].cpu() if m[b] == 0 else ref_states[b, m[b] - 1] for b in range(case.B)]
    )
    assert_rel(states[0].cpu(), expected, STATE_TOL, "committed state")


@settings(max_examples=40)
@given(case=gdn_cases(), data=st.data())
def test_verify_commit_match_recurrence(device, case, data):
    n, m = _lengths(data, case.B, case.T)
    if data.draw(st.booleans(), label="full length"):
        n = None
        m = [data.draw(st.integers(0, case.T)) for _ in range(case.B)]
    _check_round(case, device, n, m)


def test_verify_tile_widens_only_for_large_grids():
    """The verify tile: 32 columns at the 35B-A3B shape (32 value heads of 128) for B = 1, 2 and a
    half-head shard at B = 4; 64 at B = 4 with every head; never wider than V or `BV_max`."""
    assert [verify_block_v(128, b * 32) for b in (1, 2, 3, 4)] == [32, 32, 32, 64]
    assert verify_block_v(128, 4 * 16) == 32
    assert verify_block_v(32, 4 * 32) == 32 and verify_block_v(16, 1024) == 16
    assert verify_block_v(128, 4096) == 64
    assert verify_block_v(128, 4096, {**gdn_mod.VERIFY_CONFIG, "BV_max": 128}) == 128


@settings(max_examples=12)
@given(case=gdn_cases(head_dims=(64,)), data=st.data())
def test_verify_wide_tile_matches_recurrence(device, case, data):
    """With the grid rule forcing the widest tile (64 columns), the verify kernel still matches."""
    n, m = _lengths(data, case.B, case.T)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(gdn_mod.VERIFY_CONFIG, "min_programs", 1)
        assert verify_block_v(case.V, case.B * case.HV) == 64
        _check_round(case, device, n, m)


@pytest.mark.gpu
@pytest.mark.parametrize("min_programs", [gdn_mod.VERIFY_CONFIG["min_programs"], 1], ids=["default_tile", "wide_tile"])
@settings(max_examples=25)
@given(case=gdn_cases(head_dims=(128,), max_batch=4), data=st.data())
def test_verify_commit_qwen_head_dim(min_programs, case, data):
    n, m = _lengths(data, case.B, case.T)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(gdn_mod.VERIFY_CONFIG, "min_programs", min_programs)
        _check_round(case, "cuda", n, m)


def test_one_row_tile():
    """The one-row tile: `BV_one_row` rounded down to a power of two, within [16, V]."""
    assert verify_block_v_one_row(128) == 32 and verify_block_v_one_row(16) == 16
    for bv, want in ((48, 32), (8, 16), (256, 128)):
        assert verify_block_v_one_row(128, {**gdn_mod.VERIFY_CONFIG, "BV_one_row": bv}) == want


@st.composite
def one_row_inputs(draw):
    """A T = 1 case (the AR step), its `num_tokens` (None, or 0 or 1 per batch row) and whether q
    and k are l2-normalised."""
    case = dataclasses.replace(draw(gdn_cases(head_dims=(16, 32), max_batch=3)), T=1)
    n = draw(st.none() | st.lists(st.integers(0, 1), min_size=case.B, max_size=case.B))
    return case, n, draw(st.booleans())


def _one_row_case(B, HK, group, K, V, dtype, seed):
    return GDNCase(B=B, T=1, HK=HK, group=group, K=K, V=V, dtype=dtype, decay="mixed", gate="random", seed=seed)


# grouped heads with B > 1 both ways, and the Qwen head dim (K = V = 128) once
ONE_ROW_EXAMPLES = [
    (_one_row_case(3, 2, 2, 32, 16, torch.bfloat16, 1), [1, 0, 1], True),
    (_one_row_case(2, 1, 4, 16, 32, torch.float32, 2), None, False),
    (_one_row_case(2, 2, 2, 128, 128, torch.bfloat16, 3), [0, 1], True),
]


def _one_row_round(case: GDNCase, device: str, n: list[int] | None, l2norm: bool):
    """`gdn_verify` at T = 1 with the rows past `n` poisoned with NaN; returns (o, factors) and the
    twin's (o, z, k, g_cum) on the same (upcast) inputs."""
    q, k, v, g, beta, state = make_inputs(case, device)
    nt = None if n is None else torch.tensor(n, device=device, dtype=torch.int32)
    if nt is not None:
        past = (nt == 0).view(-1, 1)  # [B, T = 1]
        q, k, v, g, beta = (
            torch.where(past.view(*past.shape, *([1] * (x.dim() - 2))), torch.full_like(x, float("nan")), x)
            for x in (q, k, v, g, beta)
        )
    with expect_launch("gdn_verify"):
        o, f = gdn_verify(q, k, v, g, beta, state, num_tokens=nt, use_qk_l2norm=l2norm)
    ref = naive.gdn_verify(*(x.float().cpu() for x in (q, k, v, g, beta, state)), use_qk_l2norm=l2norm,
                           num_tokens=None if nt is None else nt.cpu())
    return (o, f), ref


@settings(max_examples=10)
@given(args=one_row_inputs())
@example(args=ONE_ROW_EXAMPLES[0])
@example(args=ONE_ROW_EXAMPLES[1])
@example(args=ONE_ROW_EXAMPLES[2])
def test_one_row_matches_recurrence(device, args):
    """The one-row path (T = 1) against the twin; a row past `num_tokens` (n = 0) gives zeros
    although its inputs are NaN."""
    case, n, l2norm = args
    with mock.patch.dict(gdn_mod.VERIFY_CONFIG, {"one_row": 1}):
        (o, f), (ref_o, ref_z, ref_k, ref_g) = _one_row_round(case, device, n, l2norm)
    assert o.dtype == case.dtype and o.shape == (case.B, 1, case.HV, case.V)
    assert_rel(o.float().cpu(), ref_o, OUT_TOL[case.dtype], "o")
    assert_rel(f.z.cpu(), ref_z, STATE_TOL, "z")
    assert_rel(f.k.cpu(), ref_k, STATE_TOL, "k")
    assert_rel(f.g_cum.cpu(), ref_g, STATE_TOL, "g_cum")
    for b in range(case.B):
        if n is not None and n[b] == 0:
            assert all(torch.equal(x[b], torch.zeros_like(x[b])) for x in (o, *f)), f"row past n in batch {b}"


@settings(max_examples=6)
@given(args=one_row_inputs())
@example(args=ONE_ROW_EXAMPLES[0])
def test_one_row_on_and_off_agree(device, args):
    """`VERIFY_CONFIG["one_row"]` picks the path at T = 1 (0: the 16-row path); both give the same
    outputs and factors within tolerance."""
    case, n, l2norm = args
    tiles = []
    pick = verify_block_v_one_row
    with mock.patch.object(gdn_mod, "verify_block_v_one_row", lambda *a: tiles.append(a) or pick(*a)):
        with mock.patch.dict(gdn_mod.VERIFY_CONFIG, {"one_row": 1}):
            (on_o, on_f), _ = _one_row_round(case, device, n, l2norm)
        assert len(tiles) == 1, "one_row on: the one-row path was not taken"
        with mock.patch.dict(gdn_mod.VERIFY_CONFIG, {"one_row": 0}):
            (off_o, off_f), _ = _one_row_round(case, device, n, l2norm)
        assert len(tiles) == 1, "one_row off: the one-row path was taken"
    assert_rel(on_o.float(), off_o.float(), OUT_TOL[case.dtype], "o")
    for name, a, b in zip(GDNFactors._fields, on_f, off_f):
        assert_rel(a, b, STATE_TOL, name)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [None, [1], [0]], ids=["all", "n1", "n0"])
def test_one_row_qwen_shape_cuda(n):
    """The AR step at the 35B-A3B shape (B = 1, 16 key and 32 value heads of 128, bf16 q, k, v as
    the model feeds them): the one-row path against the twin and against the 16-row path."""
    case = GDNCase(B=1, T=1, HK=16, group=2, K=128, V=128, dtype=torch.bfloat16, decay="mixed", gate="random",
                   seed=5)
    with mock.patch.dict(gdn_mod.VERIFY_CONFIG, {"one_row": 1}):
        (o, f), (ref_o, ref_z, ref_k, ref_g) = _one_row_round(case, "cuda", n, True)
    assert_rel(o.float().cpu(), ref_o, OUT_TOL[case.dtype], "o")
    for name, got, want in zip(GDNFactors._fields, f, (ref_z, ref_k, ref_g)):
        assert_rel(got.cpu(), want, STATE_TOL, name)
    with mock.patch.dict(gdn_mod.VERIFY_CONFIG, {"one_row": 0}):
        (off_o, off_f), _ = _one_row_round(case, "cuda", n, True)
    assert_rel(o.float(), off_o.float(), OUT_TOL[case.dtype], "o on/off")
    for name, a, b in zip(GDNFactors._fields, f, off_f):
        assert_rel(a, b, STATE_TOL, f"{name} on/off")


@settings(max_examples=8)
@given(case=gdn_cases(head_dims=(16, 32)), data=st.data(), poison=st.sampled_from(["nan", "inf", "-inf"]))
def test_rows_past_num_tokens_change_nothing(device, case, data, poison):
    n, m = _lengths(data, case.B, case.T)
    q, k, v, g, beta, state = make_inputs(case, device)
    nt = torch.tensor(n, device=device)
    past = torch.arange(case.T, device=device)[None, :] >= nt[:, None]  # [B, T]

    def poisoned(x):
        mask = past.view(*past.shape, *([1] * (x.dim() - 2)))
        return torch.where(mask, torch.full_like(x, float(poison)), x)

    clean_o, clean_f = gdn_verify(q, k, v, g, beta, state, num_tokens=nt)
    dirty_o, dirty_f = gdn_verify(*(poisoned(x) for x in (q, k, v, g, beta)), state, num_tokens=nt)
    keep = ~past
    assert torch.equal(clean_o[keep], dirty_o[keep])
    for a, b in zip(clean_f, dirty_f):
        assert torch.equal(a[keep], b[keep])
    assert torch.isfinite(dirty_o).all(), "rows past num_tokens must be written as finite values"
    s_clean, s_dirty = state[None].clone(), state[None].clone()
    mt = torch.tensor(m, device=device)
    gdn_commit(s_clean, GDNFactors(*(x[None] for x in clean_f)), mt)
    gdn_commit(s_dirty, GDNFactors(*(x[None] for x in dirty_f)), mt)
    assert torch.equal(s_clean, s_dirty)


@settings(max_examples=6)
@given(case=gdn_cases(head_dims=(16, 32), max_batch=1), t1=st.integers(1, 8), t2=st.integers(1, 8))
def test_commit_then_verify_equals_verify_of_concatenation(device, case, t1, t2):
    case = GDNCase(**{**case.__dict__, "T": t1 + t2, "dtype": torch.float32})
    q, k, v, g, beta, state = make_inputs(case, device)
    o_all, f_all = gdn_verify(q, k, v, g, beta, state)
    first = (x[:, :t1] for x in (q, k, v, g, beta))
    second = (x[:, t1:] for x in (q, k, v, g, beta))
    _, f1 = gdn_verify(*first, state)
    states = state[None].clone()
    gdn_commit(states, GDNFactors(*(x[None] for x in f1)), torch.tensor([t1], device=device))
    o2, f2 = gdn_verify(*second, states[0])
    assert_rel(o2, o_all[:, t1:], 1e-5, "outputs after commit")
    gdn_commit(states, GDNFactors(*(x[None] for x in f2)), torch.tensor([t2], device=device))
    whole = state[None].clone()
    gdn_commit(whole, GDNFactors(*(x[None] for x in f_all)), torch.tensor([t1 + t2], device=device))
    assert_rel(states, whole, 1e-5, "state after two commits")


def test_matches_transformers_recurrent_rule(device):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_recurrent_gated_delta_rule

    case = GDNCase(B=2, T=13, HK=2, group=2, K=32, V=32, dtype=torch.float32, decay="mixed", gate="random", seed=7)
    q, k, v, g, beta, state = make_inputs(case, device)
    o, f = gdn_verify(q, k, v, g, beta, state)
    states = state[None].clone()
    gdn_commit(states, GDNFactors(*(x[None] for x in f)), torch.tensor([case.T] * case.B, device=device))
    # repeat key heads here so the reference works whether or not it handles grouped heads itself
    rep = lambda x: x.repeat_interleave(case.group, dim=2)  # noqa: E731
    ref_o, ref_state = torch_recurrent_gated_delta_rule(
        rep(q), rep(k), v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert_rel(o, ref_o, 1e-5, "o vs transformers")
    assert_rel(states[0], ref_state, 1e-5, "final state vs transformers")


def test_commit_all_layers_in_one_launch(device):
    L = 3
    cases = [
        GDNCase(B=2, T=9, HK=1, group=2, K=16, V=32, dtype=torch.float32, decay="moderate", gate="random", seed=s)
        for s in range(L)
    ]
    inputs = [make_inputs(c, device) for c in cases]
    states = torch.stack([x[-1] for x in inputs])
    buf = GDNFactors(
        torch.empty(L, 2, 9, 2, 32, device=device),
        torch.empty(L, 2, 9, 1, 16, device=device),
        torch.empty(L, 2, 9, 2, device=device),
    )
    for layer, (q, k, v, g, beta, state) in enumerate(inputs):
        gdn_verify(q, k, v, g, beta, state, factors_out=GDNFactors(*(x[layer] for x in buf)))
    m = torch.tensor([4, 9], device=device)
    expected = states.clone()
    naive.gdn_commit(expected, *buf, m)
    with expect_launch("gdn_commit", 1):
        gdn_commit(states, buf, m)
    assert_rel(states, expected, 1e-5, "stacked commit")
    listed = torch.stack([x[-1] for x in inputs])
    with expect_launch("gdn_commit", 1):
        gdn_commit(listed, [GDNFactors(*(x[layer] for x in buf)) for layer in range(L)], m)
    assert torch.equal(listed, states)


@settings(max_examples=12)
@given(case=gdn_cases(head_dims=(16, 32)), data=st.data())
def test_packed_equals_split(device, case, data):
    """`gdn_verify_packed` on q, k and v side by side (as the conv writes them) is `gdn_verify` on
    the split, bit for bit, with and without `num_tokens`, on the kernel and on the naive twin."""
    q, k, v, g, beta, state = make_inputs(case, device)
    B, T = q.shape[:2]
    # the packed row's stride (2 HK K + HV V) is not a split tensor's: the kernel reads by stride
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    n = data.draw(st.lists(st.integers(1, T), min_size=B, max_size=B) | st.none(), label="num_tokens")
    nt = None if n is None else torch.tensor(n, device=device, dtype=torch.int32)
    with expect_launch("gdn_verify"):
        want, wf = gdn_verify(q, k, v, g, beta, state, num_tokens=nt)
    with expect_launch("gdn_verify"):
        got, gf = gdn_verify_packed(qkv, g, beta, state, num_k_heads=case.HK, head_k_dim=case.K, head_v_dim=case.V,
                                    num_tokens=nt)
    assert torch.equal(got, want)
    for a, b in zip(gf, wf):
        assert torch.equal(a, b)


def test_packed_rejects_a_width_that_does_not_split(device):
    case = GDNCase(B=1, T=2, HK=1, group=2, K=16, V=16, dtype=torch.float32, decay="moderate", gate="random", seed=0)
    q, k, v, g, beta, state = make_inputs(case, device)
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    with pytest.raises(ValueError, match="not 2 x 1 key heads x 16 plus value heads of 24"):
        gdn_verify_packed(qkv, g, beta, state, num_k_heads=1, head_k_dim=16, head_v_dim=24)
    # one value head fewer than g and beta have
    with pytest.raises(ValueError, match="g and beta must be"):
        gdn_verify_packed(qkv[..., :-16], g, beta, state, num_k_heads=1, head_k_dim=16, head_v_dim=16)


def _small_args(device):
    case = GDNCase(B=1, T=5, HK=1, group=2, K=16, V=16, dtype=torch.float32, decay="moderate", gate="random", seed=3)
    q, k, v, g, beta, state = make_inputs(case, device)
    nt = torch.tensor([4], device=device)
    f = GDNFactors(torch.empty(1, 1, 5, 2, 16, device=device), torch.empty(1, 1, 5, 1, 16, device=device),
                   torch.empty(1, 1, 5, 2, device=device))
    return (q, k, v, g, beta, state, nt), f


def test_opcheck(device):
    (q, k, v, g, beta, state, nt), f = _small_args(device)
    torch.library.opcheck(
        torch.ops.hybridspec.gdn_verify.default,
        (q, k, v, g, beta, state, nt, f.z[0], f.k[0], f.g_cum[0], 0.25, True),
    )
    gdn_verify(q, k, v, g, beta, state, num_tokens=nt, factors_out=GDNFactors(*(x[0] for x in f)))
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    torch.library.opcheck(
        torch.ops.hybridspec.gdn_verify_packed.default,
        (qkv, g, beta, state, nt, f.z[0], f.k[0], f.g_cum[0], 1, 16, 16, 0.25, True),
    )
    torch.library.opcheck(
        torch.ops.hybridspec.gdn_commit.default, (state[None].clone(), f.z, f.k, f.g_cum, torch.tensor([3], device=device))
    )


def test_fullgraph_compile(device):
    (q, k, v, g, beta, state, nt), f = _small_args(device)
    m = torch.tensor([3], device=device)

    def step(q, k, v, g, beta, states, nt, m, z, kk, gc):
        o, _ = gdn_verify(q, k, v, g, beta, states[0], num_tokens=nt, factors_out=GDNFactors(z[0], kk[0], gc[0]))
        gdn_commit(states, GDNFactors(z, kk, gc), m)
        return o

    eager_states, compiled_states = state[None].clone(), state[None].clone()
    eager_o = step(q, k, v, g, beta, eager_states, nt, m, *(x.clone() for x in f))
    compiled = torch.compile(step, fullgraph=True)
    compiled_o = compiled(q, k, v, g, beta, compiled_states, nt, m, *(x.clone() for x in f))
    assert torch.equal(eager_o, compiled_o)
    assert torch.equal(eager_states, compiled_states)
