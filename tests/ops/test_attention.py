"""decode_attention kernels against the naive twin (hybridspec.ops.naive_attention), causal and not
(the DFlash drafter's block), and the naive twin against the path it replaced (SDPA under an
explicit mask over the whole buffer)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import attention as attn_mod
from hybridspec.ops import decode_attention, naive_attention
from hybridspec.ops.attention import AttentionKernelConfig, launch_plan
from hybridspec.ops.dispatch import TRITON_INTERPRET
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch

# 16-bit: the output's rounding and the probabilities rounded for the P @ V product
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# small tiles on small shapes, so that the context spans several splits and blocks
SMALL = AttentionKernelConfig(block_n=16, block_n_large=16, block_m=32)


@dataclass(frozen=True)
class AttnCase:
    B: int
    W: int
    G: int  # query heads per key head
    Hkv: int
    D: int
    S: int  # buffer positions
    lengths: tuple[int, ...]  # one per batch row, or one for every row
    dtype: torch.dtype
    gate: bool
    seed: int
    # False: every new row sees the whole block (the DFlash drafter's non-causal layers)
    causal: bool = True


def make_inputs(case: AttnCase, device: str):
    """`q, keys, values, lengths, gate`; every buffer position at or past `L + W` holds NaN (a
    kernel that reads one fails), and q is scaled so that attention is neither flat nor one-hot."""
    gen = torch.Generator().manual_seed(case.seed)
    B, W, Hq, Hkv, D, S = case.B, case.W, case.G * case.Hkv, case.Hkv, case.D, case.S
    q = torch.randn(B, W, Hq, D, generator=gen) * 1.5
    keys = torch.randn(B, Hkv, S, D, generator=gen)
    values = torch.randn(B, Hkv, S, D, generator=gen)
    lengths = torch.tensor(case.lengths)
    for b in range(B):
        L = case.lengths[b if len(case.lengths) > 1 else 0]
        keys[b, :, L + W:] = float("nan")
        values[b, :, L + W:] = float("nan")
    gate = torch.randn(B, W, Hq, D, generator=gen) * 2 if case.gate else None
    out = (x if x is None or not x.is_floating_point() else x.to(case.dtype) for x in (q, keys, values, lengths, gate))
    return tuple(None if x is None else x.to(device) for x in out)


@st.composite
def attn_cases(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16)):
    B = draw(st.integers(1, 2), label="B")
    W = draw(st.sampled_from([1, 2, 5, 16]), label="W")
    G = draw(st.sampled_from([1, 2, 4]), label="G")
    Hkv = draw(st.integers(1, 2), label="Hkv")
    # non-powers of two exercise the masked head dim
    D = draw(st.sampled_from([16, 24, 32]), label="D")
    S = draw(st.integers(W, 70), label="S")
    n = draw(st.sampled_from([1, B]), label="lengths")
    lengths = tuple(draw(st.integers(0, S - W), label=f"L{b}") for b in range(n))
    return AttnCase(B, W, G, Hkv, D, S, lengths, draw(st.sampled_from(dtypes), label="dtype"),
                    draw(st.booleans(), label="gate"), draw(st.integers(0, 2**16), label="seed"),
                    draw(st.booleans(), label="causal"))


def _reference(args, causal=True):
    q, keys, values, lengths, gate = (None if a is None else a.cpu() for a in args)
    return naive_attention.decode_attention(q, keys, values, lengths, q.shape[-1] ** -0.5, gate, causal=causal)


def _run(case: AttnCase, device: str, monkeypatch, cfg: AttentionKernelConfig = SMALL):
    monkeypatch.setattr(attn_mod, "KERNEL_CONFIG", cfg)
    args = make_inputs(case, device)
    q, keys, values, lengths, gate = args
    with expect_launch("decode_attention_split"), expect_launch("decode_attention_combine"):
        out = decode_attention(q, keys, values, lengths, gate=gate, causal=case.causal)
    assert out.dtype == case.dtype and out.shape == q.shape and out.is_contiguous()
    return out, args


@settings(max_examples=10)
@given(case=attn_cases())
@example(case=AttnCase(B=2, W=16, G=2, Hkv=2, D=32, S=64, lengths=(0, 48), dtype=torch.bfloat16, gate=True, seed=0))
@example(case=AttnCase(B=1, W=1, G=4, Hkv=1, D=16, S=40, lengths=(39,), dtype=torch.float32, gate=False, seed=1))
@example(case=AttnCase(B=2, W=16, G=4, Hkv=1, D=32, S=50, lengths=(34, 3), dtype=torch.float32, gate=False, seed=2,
                       causal=False))
def test_matches_naive(device, monkeypatch, case):
    out, args = _run(case, device, monkeypatch)
    assert_rel(out.cpu().float(), _reference(args, case.causal).float(), TOL[case.dtype], "out vs naive")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits", [1, 2, 3, 64])
def test_every_split_count(device, monkeypatch, splits, causal):
    """One split (no merge), uneven splits, and more splits than the context has blocks (the empty
    ones exit; the combine counts only the used ones). L + W = 48 ends on a block boundary: the
    non-causal rows' last positions sit in the last split."""
    case = AttnCase(B=1, W=11, G=2, Hkv=2, D=16, S=60, lengths=(37,), dtype=torch.float32, gate=False, seed=splits,
                    causal=causal)
    cfg = AttentionKernelConfig(block_n=16, splits=splits)
    out, args = _run(case, device, monkeypatch, cfg)
    assert_rel(out.cpu(), _reference(args, causal), TOL[torch.float32], f"{splits} splits")


def test_rows_see_only_their_prefix(device, monkeypatch):
    """Changing the key and value of position L + j changes rows j.. only."""
    case = AttnCase(B=1, W=6, G=2, Hkv=1, D=16, S=30, lengths=(9,), dtype=torch.float32, gate=False, seed=3)
    out, (q, keys, values, lengths, _) = _run(case, device, monkeypatch)
    j = 3
    keys, values = keys.clone(), values.clone()
    keys[:, :, 9 + j] += 5.0
    values[:, :, 9 + j] -= 3.0
    changed = decode_attention(q, keys, values, lengths)
    assert torch.equal(changed[:, :j], out[:, :j])
    assert not torch.allclose(changed[:, j:], out[:, j:])


def test_noncausal_rows_see_the_whole_block(device, monkeypatch):
    """Not causal: changing the key and value of the block's last position L + W - 1 changes every
    row, and position L + W (NaN) is still never read."""
    case = AttnCase(B=1, W=6, G=2, Hkv=1, D=16, S=30, lengths=(9,), dtype=torch.float32, gate=False, seed=3,
                    causal=False)
    out, (q, keys, values, lengths, _) = _run(case, device, monkeypatch)
    keys, values = keys.clone(), values.clone()
    keys[:, :, 9 + 5] += 5.0
    values[:, :, 9 + 5] -= 3.0
    changed = decode_attention(q, keys, values, lengths, causal=False)
    assert torch.isfinite(changed).all()
    assert all(not torch.allclose(changed[:, i], out[:, i]) for i in range(6))


def test_one_length_for_every_row(device, monkeypatch):
    case = AttnCase(B=2, W=3, G=2, Hkv=1, D=16, S=24, lengths=(11,), dtype=torch.float32, gate=True, seed=4)
    out, (q, keys, values, lengths, gate) = _run(case, device, monkeypatch)
    per_row = decode_attention(q, keys, values, lengths.expand(2).clone(), gate=gate)
    assert torch.equal(out, per_row)


def test_strided_query_and_gate(device, monkeypatch):
    """q and gate as the attention layer passes them: views of one projection, transposed."""
    monkeypatch.setattr(attn_mod, "KERNEL_CONFIG", SMALL)
    gen = torch.Generator().manual_seed(5)
    B, W, Hq, Hkv, D, S = 1, 4, 4, 2, 16, 20
    proj = torch.randn(B, W, Hq, 2 * D, generator=gen)
    q, gate = torch.chunk(proj, 2, dim=-1)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, W, Hq, D] with SDPA's memory order
    keys, values = torch.randn(2, B, Hkv, S, D, generator=gen)
    lengths = torch.tensor([7])
    args = tuple(t.to(device) for t in (q, keys, values, lengths, gate))
    out = decode_attention(args[0], args[1], args[2], args[3], gate=args[4])
    ref = naive_attention.decode_attention(q.contiguous(), keys, values, lengths, D**-0.5, gate.contiguous())
    assert_rel(out.cpu(), ref, TOL[torch.float32], "strided")


def _masked_sdpa(q, keys, values, start, scale, causal=True):
    """The attention `patches/common.py` ran before (and the drafter's layers, `causal=False`): SDPA
    over the whole buffer under a mask."""
    B, W, Hq, D = q.shape
    rows = start + (torch.arange(W) if causal else torch.full((W,), W - 1))
    allowed = torch.arange(keys.shape[2])[None, :] <= rows[:, None]
    return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=allowed[None, None],
                                          scale=scale, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("W, L", [(1, 0), (7, 12), (16, 40)])
def test_naive_matches_the_masked_sdpa_it_replaced(W, L, causal):
    case = AttnCase(B=1, W=W, G=4, Hkv=2, D=32, S=64, lengths=(L,), dtype=torch.float32, gate=False, seed=W)
    q, keys, values, lengths, _ = make_inputs(case, "cpu")
    # SDPA reads every position: give it finite stale rows where the inputs hold NaN
    keys, values = (torch.nan_to_num(t, nan=0.25) for t in (keys, values))
    ours = naive_attention.decode_attention(q, keys, values, lengths, 0.3, None, causal=causal)
    # the op's body on CPU: contiguous, as the fake kernel declares
    assert ours.is_contiguous()
    assert_rel(ours, _masked_sdpa(q, keys, values, lengths, 0.3, causal), 1e-6, "naive vs masked SDPA")


def test_launch_plan_spreads_long_contexts():
    """At the 35B-A3B shape on 132 SMs: 16 rows x 8 heads per key head in two row blocks, and the
    split count fills the GPU however long the context is (it is fixed by the buffer, not L)."""
    cfg = AttentionKernelConfig()
    plan = launch_plan(cfg, B=1, W=16, Hq=16, Hkv=2, S=8192 + 64, D=256, sms=132)
    assert (plan["BM"], plan["row_blocks"], plan["BN"]) == (64, 2, 32)
    assert plan["splits"] == 33
    # one row block at W = 1
    assert launch_plan(cfg, B=1, W=1, Hq=16, Hkv=2, S=8192, D=256, sms=132)["splits"] == 64
    # a short buffer has no more splits than blocks
    assert launch_plan(cfg, B=1, W=1, Hq=16, Hkv=2, S=40, D=256, sms=132)["splits"] == 2
    # fp32 at head dim 256 takes 32-row blocks (64 did not fit the H200's shared memory)
    fp32 = launch_plan(cfg, B=1, W=16, Hq=16, Hkv=2, S=8192 + 64, D=256, sms=132, elem_size=4)
    assert (fp32["BM"], fp32["row_blocks"]) == (32, 4)


def test_opcheck(device, monkeypatch):
    monkeypatch.setattr(attn_mod, "KERNEL_CONFIG", SMALL)
    case = AttnCase(B=1, W=3, G=2, Hkv=1, D=16, S=20, lengths=(5,), dtype=torch.float32, gate=True, seed=6)
    q, keys, values, lengths, gate = make_inputs(case, device)
    # opcheck detects mutation by comparing the inputs before and after a call: NaN never compares equal
    keys, values = (torch.nan_to_num(t) for t in (keys, values))
    op = torch.ops.hybridspec.decode_attention.default
    torch.library.opcheck(op, (q, keys, values, lengths, gate, 0.25))
    torch.library.opcheck(op, (q, keys, values, lengths, None, 0.25))
    # the drafter's call: left padding, not causal, no gate
    torch.library.opcheck(op, (q, keys, values, lengths, None, 0.25, torch.tensor([2], device=q.device), False))


def test_fullgraph_compile(device, monkeypatch):
    monkeypatch.setattr(attn_mod, "KERNEL_CONFIG", SMALL)
    case = AttnCase(B=1, W=3, G=2, Hkv=1, D=16, S=20, lengths=(5,), dtype=torch.float32, gate=True, seed=7)
    q, keys, values, lengths, gate = make_inputs(case, device)

    def layer(q, keys, values, lengths, gate):
        return decode_attention(q * 2, keys, values, lengths, gate=gate) + decode_attention(q, keys, values, lengths,
                                                                                            causal=False)

    eager = layer(q, keys, values, lengths, gate)
    compiled = torch.compile(layer, fullgraph=True)(q, keys, values, lengths, gate)
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "q": a["q"][..., :8]}, r"keys must be \[B, Hkv, S, D\] = \[1, Hkv, S, 8\]"),
        (lambda a: {**a, "values": a["values"][:, :, :10]}, r"values must match keys"),
        (lambda a: {**a, "keys": a["keys"].repeat(1, 3, 1, 1), "values": a["values"].repeat(1, 3, 1, 1)},
         r"query heads \(4\) must be a multiple of key heads \(6\)"),
        (lambda a: {**a, "keys": a["keys"].double()}, "must have q's dtype"),
        (lambda a: {**a, "lengths": a["lengths"].float()}, "lengths must be an integer tensor"),
        (lambda a: {**a, "lengths": torch.tensor([[3]])}, r"lengths must be an integer tensor of shape \[B\]"),
        (lambda a: {**a, "gate": a["q"][:, :, :2]}, r"gate must be \[B, W, Hq, D\]"),
        (lambda a: {**a, "q": a["q"].transpose(2, 3).contiguous().transpose(2, 3)}, "q must be contiguous in its last dim"),
        (lambda a: {**a, "keys": a["keys"][:, :, :2], "values": a["values"][:, :, :2]}, r"at least the W = 3 new rows"),
    ],
)
def test_wrapper_validates(change, match):
    case = AttnCase(B=1, W=3, G=2, Hkv=2, D=16, S=20, lengths=(5,), dtype=torch.float32, gate=True, seed=8)
    q, keys, values, lengths, gate = make_inputs(case, "cpu")
    args = change(dict(q=q, keys=keys, values=values, lengths=lengths, gate=gate))
    with pytest.raises(ValueError, match=match):
        decode_attention(args.pop("q"), args.pop("keys"), args.pop("values"), args.pop("lengths"), **args)


# the real shapes: the 35B-A3B attention layer (16 query / 2 key heads, D = 256), a tensor-parallel
# shard of it (8 / 1), the other head dims, and batch rows of different lengths
GPU_CASES = [
    AttnCase(B=1, W=W, G=8, Hkv=2, D=256, S=8192 + 64, lengths=(L,), dtype=torch.bfloat16, gate=True, seed=W + L)
    for W in (1, 4, 16) for L in (0, 511, 8192 + 64 - 16)
] + [
    AttnCase(B=1, W=16, G=8, Hkv=1, D=256, S=4096, lengths=(3000,), dtype=torch.bfloat16, gate=True, seed=1),
    AttnCase(B=4, W=16, G=4, Hkv=2, D=128, S=2048, lengths=(0, 100, 1000, 2032), dtype=torch.float16, gate=False, seed=2),
    AttnCase(B=2, W=4, G=2, Hkv=4, D=64, S=1024, lengths=(5, 900), dtype=torch.float32, gate=True, seed=3),
    AttnCase(B=1, W=16, G=8, Hkv=2, D=256, S=2048, lengths=(700,), dtype=torch.float32, gate=True, seed=4),
]


# the DFlash drafter's layers at the 35B-A3B drafter shape (32 query / 4 key heads, D = 128, no
# gate; its full-attention layers are the non-causal parameter below)
GPU_CASES += [
    AttnCase(B=B, W=16, G=8, Hkv=4, D=128, S=8192 + 16, lengths=lengths, dtype=torch.bfloat16, gate=False, seed=B)
    for B, lengths in ((1, (0,)), (1, (3000,)), (4, (17, 500, 4096, 8192)))
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "block"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"B{c.B}-W{c.W}-G{c.G}-Hkv{c.Hkv}-D{c.D}-L{c.lengths}-{c.dtype}")
def test_real_shapes(monkeypatch, case, causal):
    case = dataclasses.replace(case, causal=causal)
    out, args = _run(case, "cuda", monkeypatch, AttentionKernelConfig())
    ref = naive_attention.decode_attention(*args[:4], case.D**-0.5, args[4], causal=causal)
    assert_rel(out.float(), ref.float(), TOL[case.dtype], "out vs naive")
    # as the verification forward calls it: with each row's left padding (NaN there: never read)
    q, keys, values, lengths, gate = args
    starts = lengths.expand(case.B) // 3
    keys, values = keys.clone(), values.clone()
    for b, first in enumerate(starts.tolist()):
        keys[b, :, :first] = float("nan")
        values[b, :, :first] = float("nan")
    out = decode_attention(q, keys, values, lengths, gate=gate, starts=starts, causal=causal)
    ref = naive_attention.decode_attention(q, keys, values, lengths, case.D**-0.5, gate, starts, causal)
    assert_rel(out.float(), ref.float(), TOL[case.dtype], "with starts: out vs naive")


@pytest.mark.gpu
# not a missing feature: Triton's interpreter runs kernels on host copies of CUDA tensors, and a
# CUDA-graph capture forbids those copies (the same limit as test_moe's graph test)
@pytest.mark.skipif(TRITON_INTERPRET, reason="the interpreter copies CUDA tensors to the host, which capture forbids")
def test_cuda_graph_replays_other_lengths():
    """Captured once, replayed as the length moves from 0 to the end of the buffer: the split sizes
    follow the device length."""
    case = AttnCase(B=1, W=16, G=8, Hkv=2, D=256, S=8192 + 64, lengths=(0,), dtype=torch.bfloat16, gate=True, seed=9)
    q, keys, values, lengths, gate = make_inputs(case, "cuda")
    keys, values = (torch.nan_to_num(t) for t in (keys, values))
    starts = torch.zeros_like(lengths)
    decode_attention(q, keys, values, lengths, gate=gate, starts=starts)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, keys, values, lengths, gate=gate, starts=starts)
    for L in (0, 17, 511, 4000, 8192 + 64 - 16):
        lengths.fill_(L)
        starts.fill_(L // 4)
        graph.replay()
        ref = naive_attention.decode_attention(q, keys, values, lengths, case.D**-0.5, gate, starts)
        assert_rel(out.float(), ref.float(), TOL[case.dtype], f"replayed at L = {L}")


@settings(max_examples=8)
@given(case=attn_cases(dtypes=(torch.float32, torch.bfloat16)), data=st.data())
@example(case=AttnCase(B=2, W=4, G=2, Hkv=1, D=16, S=60, lengths=(20, 40), dtype=torch.float32, gate=True, seed=5),
         data=None)
@example(case=AttnCase(B=2, W=16, G=2, Hkv=1, D=16, S=60, lengths=(20, 40), dtype=torch.float32, gate=False, seed=6,
                       causal=False), data=None)
def test_left_padding_starts(device, monkeypatch, case, data):
    """`starts` (left padding): the kernels match the naive twin, and both equal attention over the
    buffer with the padding cut off. Padded positions hold NaN: a kernel that read one would
    return NaN."""
    monkeypatch.setattr(attn_mod, "KERNEL_CONFIG", SMALL)
    q, keys, values, lengths, gate = make_inputs(case, device)
    Ls = lengths.expand(case.B).tolist()
    starts = [0 if data is None else data.draw(st.integers(0, L), label=f"start{b}") for b, L in enumerate(Ls)]
    if data is None:
        starts = [7, 33]
    for b, s in enumerate(starts):
        keys[b, :, :s] = float("nan")
        values[b, :, :s] = float("nan")
    starts_t = torch.tensor(starts, device=device)
    out = decode_attention(q, keys, values, lengths, gate=gate, starts=starts_t, causal=case.causal)
    ref = naive_attention.decode_attention(q.cpu(), keys.cpu(), values.cpu(), lengths.cpu(), case.D**-0.5,
                                           None if gate is None else gate.cpu(), starts_t.cpu(), case.causal)
    assert_rel(out.cpu().float(), ref.float(), TOL[case.dtype], "starts: out vs naive")
    for b, s in enumerate(starts):
        cut = naive_attention.decode_attention(
            q[b:b + 1].cpu(), keys[b:b + 1, :, s:].cpu().contiguous(), values[b:b + 1, :, s:].cpu().contiguous(),
            torch.tensor([Ls[b] - s]), case.D**-0.5, None if gate is None else gate[b:b + 1].cpu(), causal=case.causal)
        assert_rel(ref[b:b + 1].float(), cut.float(), TOL[case.dtype], f"row {b}: starts vs the cut buffer")
