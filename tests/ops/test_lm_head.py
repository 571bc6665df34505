"""lm_head_top1 kernels against the naive twin (hybridspec.ops.naive_lm_head: the eager logits,
torch.argmax and an fp32 softmax), ties included, and its use in `DFlashDrafter.propose`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import lm_head as head_mod
from hybridspec.ops import lm_head_top1, naive_lm_head
from hybridspec.ops.lm_head import LMHeadKernelConfig
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch

# small vocabulary tiles and combine chunks, so that small shapes span several of each
SMALL = LMHeadKernelConfig(block_v=32, block_k=32, block_m=32, combine_tiles=4)
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
# probabilities of the same logits summed in another order; Gaussian 16-bit data may also round a
# logit to its neighbour now and then (another accumulation order)
TOL = 1e-5
TOL_16BIT = 2e-3


@dataclass(frozen=True)
class HeadCase:
    N: int
    H: int
    V: int
    dtype: torch.dtype
    scale: float
    # "grid": values on a coarse grid, so every accumulation order gives the same fp32 sums and the
    # same rounded logits (ties after rounding are common and must break alike); "normal": Gaussian;
    # "dup": the grid with row 0's best weight row copied to other indices (exact ties that must
    # break to the first copy)
    data: str
    seed: int

    @property
    def on_grid(self) -> bool:
        """Whether the data lie on the grid ("grid", "dup"): fp32 sums exact in any order."""
        return self.data in ("grid", "dup")


def make_inputs(case: HeadCase, device: str):
    # drawn on the device: a 248,320 x 2048 weight takes seconds to draw on the host
    gen = torch.Generator(device=device).manual_seed(case.seed)
    N, H, V = case.N, case.H, case.V
    # "dup" copies the best row into three others on the grid too: its logits are exact in fp32 in
    # any summation order, so the copies tie exactly wherever the dot runs (under the interpreter
    # numpy's matmul gives identical columns of normal data different last bits by their position
    # in a tile, seed 269 of the old normal-data case, and a tie rule cannot be checked there)
    if case.on_grid:
        hidden = torch.randint(-2, 3, (N, H), generator=gen, device=device) / 2
        weight = torch.randint(-8, 9, (V, H), generator=gen, device=device) / 8
    else:
        hidden = torch.randn(N, H, generator=gen, device=device) * 2
        weight = torch.randn(V, H, generator=gen, device=device) * H**-0.5
    if case.data == "dup":
        best = int((hidden[0].double() @ weight.double().T).argmax())
        copies = torch.randint(V, (3,), generator=gen, device=device)
        weight[copies] = weight[best].clone()
    return hidden.to(case.dtype), weight.to(case.dtype)


@st.composite
def head_cases(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16)):
    return HeadCase(
        N=draw(st.sampled_from([1, 3, 15, 40]), label="N"),
        H=draw(st.sampled_from([16, 32, 48]), label="H"),
        V=draw(st.integers(1, 300), label="V"),
        dtype=draw(st.sampled_from(dtypes), label="dtype"),
        scale=draw(st.sampled_from([1.0, 0.5, 1.7]), label="scale"),
        data=draw(st.sampled_from(["grid", "normal", "dup"]), label="data"),
        seed=draw(st.integers(0, 2**16), label="seed"),
    )


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - MANTISSA[dtype])


def check_against_naive(case: HeadCase, hidden, weight, got):
    """The naive twin runs on the kernel's device (on CUDA: cuBLAS, the path the op replaces)."""
    ref_tokens, ref_conf, ref_ent = (t.cpu() for t in naive_lm_head.lm_head_top1(hidden, weight, case.scale))
    tokens, confidence, entropy = (t.cpu() for t in got)
    assert tokens.dtype == torch.long and confidence.dtype == entropy.dtype == torch.float32
    assert tokens.shape == confidence.shape == entropy.shape == (case.N,)
    differ = (tokens != ref_tokens).nonzero().flatten().tolist()
    if case.on_grid:
        assert differ == [], f"tokens differ at rows {differ} on data whose logits round alike"
    # elsewhere only at a near-tie (the two tokens' exact logits within two roundings), and never
    # between copies of one weight row, which tie exactly and must break to the first
    for n in differ:
        pair = torch.stack([tokens[n], ref_tokens[n]]).to(weight.device)
        assert not torch.equal(weight[pair[0]], weight[pair[1]]), f"row {n}: a later copy of the maximum won"
        a, b = (hidden[n].double() @ weight[pair].double().T * case.scale).cpu()
        assert (a - b).abs() <= 2 * _ulp(torch.maximum(a.abs(), b.abs()), case.dtype), (
            f"row {n}: token {tokens[n]} (logit {a:.6g}) vs {ref_tokens[n]} ({b:.6g}) is no near-tie")
    tol = TOL_16BIT if not case.on_grid and case.dtype != torch.float32 else TOL
    assert_rel(confidence, ref_conf, tol, "confidence")
    assert_rel(entropy, ref_ent, tol, "entropy")


def _run(case: HeadCase, device: str, monkeypatch, cfg: LMHeadKernelConfig = SMALL):
    monkeypatch.setattr(head_mod, "KERNEL_CONFIG", cfg)
    hidden, weight = make_inputs(case, device)
    with expect_launch("lm_head_partial"), expect_launch("lm_head_combine"):
        got = lm_head_top1(hidden, weight, scale=case.scale)
    return got, hidden, weight


@settings(max_examples=16)
@given(case=head_cases())
@example(case=HeadCase(N=40, H=48, V=300, dtype=torch.bfloat16, scale=1.0, data="grid", seed=0))
@example(case=HeadCase(N=15, H=32, V=257, dtype=torch.float32, scale=1.7, data="dup", seed=1))
# copies in two tiles at the small config's 32-column tiles (the normal-data version of it failed)
@example(case=HeadCase(N=40, H=16, V=55, dtype=torch.float32, scale=1.0, data="dup", seed=269))
# row 0's maximum at columns 1, 45, 173 and 551: a copy in the combine's second chunk of 16 tiles,
# which must not win (flipping the kernels' `tie_break_left` passes under the interpreter, whose
# argmax seems to break ties to the left either way: this is where a tie rule of ours shows on the CPU)
@example(case=HeadCase(N=3, H=32, V=600, dtype=torch.float32, scale=1.0, data="dup", seed=2))
def test_matches_naive(device, monkeypatch, case):
    got, hidden, weight = _run(case, device, monkeypatch)
    check_against_naive(case, hidden, weight, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ties_pick_the_first_index(device, monkeypatch, dtype):
    """Maxima shared exactly and maxima shared only after rounding, within a tile, across tiles and
    across combine chunks: the first index of the maximum wins, as torch.argmax picks it."""
    V, H = 300, 16
    gen = torch.Generator().manual_seed(2)
    weight = torch.zeros(V, H)
    weight[:, :2] = torch.randint(-4, 5, (V, 2), generator=gen) / 8
    a, c, b = 5, 6, 200  # a, c in tile 0; b in tile 6, another combine chunk (SMALL: 32-row tiles, 4 per chunk)
    weight[a, :2] = torch.tensor([256.0, 0.0])
    weight[c, :2] = torch.tensor([256.0, 0.0])
    weight[b, :2] = torch.tensor([256.0, 1.0])
    hidden = torch.zeros(4, H)
    hidden[0, :2] = torch.tensor([1.0, 1.0])  # a, c: 256; b: 257, which is 256 in bf16
    hidden[1, :2] = torch.tensor([1.0, 2.0])  # b: 258, the one maximum in every dtype
    hidden[2, :2] = torch.tensor([1.0, 0.0])  # a, c, b: 256 exactly
    hidden[3, :2] = torch.tensor([1.0, -1.0])  # b: 255, below a and c in every dtype
    hidden, weight = hidden.to(dtype).to(device), weight.to(dtype).to(device)
    monkeypatch.setattr(head_mod, "KERNEL_CONFIG", SMALL)
    got = lm_head_top1(hidden, weight)
    expected = [a if dtype == torch.bfloat16 else b, b, a, a]
    assert got[0].tolist() == expected
    case = HeadCase(N=4, H=H, V=V, dtype=dtype, scale=1.0, data="grid", seed=0)
    check_against_naive(case, hidden, weight, got)
    # three tied maxima (bf16 row 0): probability 1/3 each, entropy log 3
    if dtype == torch.bfloat16:
        assert abs(got[1][0].item() - 1 / 3) < 1e-6 and abs(got[2][0].item() - math.log(3)) < 1e-6


def test_rows_past_one_block(device, monkeypatch):
    """More rows than one program holds: a second row block reads the weight again."""
    case = HeadCase(N=40, H=32, V=100, dtype=torch.float32, scale=1.0, data="grid", seed=3)
    got, hidden, weight = _run(case, device, monkeypatch, LMHeadKernelConfig(block_m=16, block_v=32, block_k=16))
    check_against_naive(case, hidden, weight, got)


def test_opcheck(device, monkeypatch):
    monkeypatch.setattr(head_mod, "KERNEL_CONFIG", SMALL)
    hidden, weight = make_inputs(HeadCase(N=3, H=16, V=50, dtype=torch.float32, scale=1.0, data="normal", seed=4), device)
    op = torch.ops.hybridspec.lm_head_top1.default
    torch.library.opcheck(op, (hidden, weight, 1.0))
    torch.library.opcheck(op, (hidden, weight, 0.5))


def test_fullgraph_compile(device, monkeypatch):
    monkeypatch.setattr(head_mod, "KERNEL_CONFIG", SMALL)
    hidden, weight = make_inputs(HeadCase(N=5, H=16, V=70, dtype=torch.float32, scale=1.0, data="normal", seed=5), device)

    def draft(hidden, weight):
        tokens, conf, ent = lm_head_top1(hidden * 2, weight, scale=0.5)
        return tokens + 1, conf * 2, ent

    eager = draft(hidden, weight)
    compiled = torch.compile(draft, fullgraph=True)(hidden, weight)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda h, w: (h[0], w), r"hidden must be \[N, H\]"),
        (lambda h, w: (h, w[:, :8]), r"weight must be \[V, H\] = \[V, 16\]"),
        (lambda h, w: (h, w.double()), "must have hidden's dtype"),
        (lambda h, w: (h.double(), w.double()), "hidden must be fp32, bf16 or fp16"),
        (lambda h, w: (h, w.t().contiguous().t()), "contiguous in their last dim"),
    ],
)
def test_wrapper_validates(change, match):
    hidden, weight = make_inputs(HeadCase(N=3, H=16, V=50, dtype=torch.float32, scale=1.0, data="normal", seed=6), "cpu")
    with pytest.raises(ValueError, match=match):
        lm_head_top1(*change(hidden, weight))


def _drafter_pair(device, **overrides):
    from tests.models import TAPS, config, qwen35_causal_lm, random_drafter

    target = qwen35_causal_lm().to(device)
    drafter = random_drafter(config(**overrides)).to(device).bind(target)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 100, (2, 12), generator=gen)
    features = torch.randn(2, 12, len(TAPS) * target.config.hidden_size, generator=gen)
    drafter.start(prompt.to(device), features.to(device))
    return drafter, prompt.to(device)


def _eager_block(drafter, anchor):
    """The drafts as `propose` computed them before the fused op: full logits, argmax, softmax."""
    captured = {}
    norm = drafter.norm
    hook = norm.register_forward_hook(lambda m, a, out: captured.__setitem__("h", out))
    drafter.propose(anchor)
    hook.remove()
    with torch.no_grad():
        logits = drafter.compute_logits(captured["h"][:, 1:])
    probs = torch.softmax(logits.float(), -1)
    return logits.argmax(-1), probs.max(-1).values, torch.special.entr(probs).sum(-1), norm


@pytest.mark.parametrize("overrides, fused", [({}, True), ({"output_multiplier": 0.7}, True),
                                               ({"final_logit_softcapping": 3.0}, False)])
def test_drafter_uses_the_fused_head(device, overrides, fused):
    """`DFlashDrafter.propose` drafts through lm_head_top1 (one launch for the B x 15 rows) unless
    the checkpoint softcaps its logits, and drafts what the full logits give."""
    drafter, prompt = _drafter_pair(device, **overrides)
    anchor = prompt[:, -1]
    tokens, conf, ent, _ = _eager_block(drafter, anchor)
    with expect_launch("lm_head_partial", 1 if fused else 0):
        block = drafter.propose(anchor)
    assert torch.equal(block.tokens, tokens)
    assert_rel(block.confidence, conf, 1e-5, "confidence")
    assert_rel(block.entropy, ent, 1e-5, "entropy")


# the 35B-A3B drafter's head: vocabulary 248,320, hidden 2048, bf16; B x 15 rows for B = 1 and 4
GPU_CASES = [
    HeadCase(N=N, H=2048, V=248_320, dtype=torch.bfloat16, scale=1.0, data=data, seed=N)
    for N in (1, 15, 60) for data in ("normal", "grid")
] + [
    HeadCase(N=15, H=2048, V=248_320, dtype=torch.bfloat16, scale=1.7, data="dup", seed=8),
    HeadCase(N=15, H=1024, V=151_936, dtype=torch.float16, scale=1.0, data="normal", seed=9),
    HeadCase(N=64, H=512, V=50_000, dtype=torch.float32, scale=1.0, data="normal", seed=10),
    HeadCase(N=100, H=256, V=1000, dtype=torch.bfloat16, scale=1.0, data="grid", seed=11),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"N{c.N}-H{c.H}-V{c.V}-{c.dtype}-{c.data}-s{c.scale}")
def test_real_shapes(monkeypatch, case):
    if case.on_grid:
        # the sums are exact only if cuBLAS also reduces in fp32 (its default may reduce 16-bit partials)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", False)
    got, hidden, weight = _run(case, "cuda", monkeypatch, LMHeadKernelConfig())
    check_against_naive(case, hidden, weight, got)
