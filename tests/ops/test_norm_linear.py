"""`gated_norm_linear_partials` (a GDN mixer's gated RMSNorm inside its output projection's split-K
partials) against its naive twin, the twin against transformers' `RMSNormGated`, and
`split_gated_out_projection` in the verification forward of both families."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNormGated
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

from hybridspec.ops import linear as linear_ops
from hybridspec.ops import naive_linear
from hybridspec.ops.dispatch import use_triton
from hybridspec.ops.naive_linear import split_span
from hybridspec.ops.norm_linear import fits_gated, gated_norm_linear_partials
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch

# fp32: another summation order (3xTF32 on the GPU); 16-bit: the normed input is rounded to the
# dtype on both sides, and another rsqrt or exp can move an element across a rounding boundary (one
# ulp of one element), which the norm-wise error of the fp32 partials shows as ~2**-8 / sqrt(K)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-10}
EPS = 1e-6


@dataclass(frozen=True)
class NormCase:
    M: int
    heads: int
    G: int
    N: int
    splits: int
    dtype: torch.dtype
    seed: int
    # x's and the gate's row strides past K (a column slice of a wider activation, as z is of the
    # mixer's fused input projection)
    x_pad: int = 0
    gate_pad: int = 0


def make_inputs(case: NormCase, device: str):
    """x, the activated gate (`silu(gate.float())`, fp32, as the caller passes it), the norm's
    weight and the projection's; what of their buffers lies outside them is NaN, so a read past a
    mask fails."""
    gen = torch.Generator().manual_seed(case.seed)
    M, K, N = case.M, case.heads * case.G, case.N

    def padded(rows, cols, pad, scale=1.0):
        t = torch.full((rows, cols + pad), float("nan"))
        # heads of different scales: a norm over the wrong columns gives other values
        t[:, :cols] = torch.randn(rows, cols, generator=gen) * scale
        return t.to(case.dtype)

    scales = torch.rand(case.heads, generator=gen).repeat_interleave(case.G) * 4 + 0.1
    x = padded(M, K, case.x_pad)
    x[:, :K] *= scales.to(case.dtype)
    x = x.to(device)[:, :K]
    act = F.silu(padded(M, K, case.gate_pad, 2.0).float()).to(device)[:, :K]
    norm_weight = (torch.rand(case.G, generator=gen) + 0.5).to(case.dtype).to(device)
    weight = padded(N, K, 0, K**-0.5).to(device)
    return x, act, norm_weight, weight


def group_fits(case: NormCase) -> bool:
    K = case.heads * case.G
    return case.splits == 1 or split_span(K, case.splits) % case.G == 0


@st.composite
def norm_cases(draw):
    return NormCase(
        M=draw(st.sampled_from([1, 2, 5, 16, 17, 64]), label="M"),
        heads=draw(st.sampled_from([1, 2, 3, 4, 8]), label="heads"),
        G=draw(st.sampled_from([16, 32, 64]), label="G"),
        N=draw(st.sampled_from([1, 7, 16, 33]), label="N"),
        splits=draw(st.sampled_from([1, 2, 4]), label="splits"),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), label="dtype"),
        seed=draw(st.integers(0, 2**16), label="seed"),
        x_pad=draw(st.sampled_from([0, 0, 5]), label="x_pad"),
        gate_pad=draw(st.sampled_from([0, 24]), label="gate_pad"),
    )


def check_case(case: NormCase, device: str) -> None:
    x, act, nw, w = make_inputs(case, device)
    with expect_launch("gated_norm_linear_partials"):
        got = gated_norm_linear_partials(x, act, nw, w, case.splits, eps=EPS)
    assert got.shape == (case.splits, case.M, case.N) and got.dtype == torch.float32
    ref = naive_linear.gated_norm_linear_partials(x.cpu(), act.cpu(), nw.cpu(), w.cpu(), case.splits, EPS)
    assert_rel(got.cpu(), ref, TOL[case.dtype], f"gated partials {case}")


@settings(max_examples=20, deadline=None)
@given(case=norm_cases())
@example(case=NormCase(M=64, heads=8, G=16, N=33, splits=4, dtype=torch.bfloat16, seed=0, x_pad=5, gate_pad=24))
@example(case=NormCase(M=1, heads=4, G=32, N=16, splits=4, dtype=torch.float32, seed=1))
@example(case=NormCase(M=17, heads=3, G=64, N=7, splits=1, dtype=torch.float16, seed=2, gate_pad=24))
@example(case=NormCase(M=64, heads=2, G=256, N=16, splits=2, dtype=torch.float32, seed=3))
def test_matches_naive(device, case):
    assume(group_fits(case))
    check_case(case, device)


@pytest.mark.parametrize("norm_cls", [Qwen3_5MoeRMSNormGated, Qwen3NextRMSNormGated])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_is_transformers_norm(norm_cls, dtype):
    """The twin computes the families' `RMSNormGated` forward bit for bit (CPU), over each group."""
    case = NormCase(M=5, heads=3, G=16, N=4, splits=1, dtype=dtype, seed=3)
    x, _, nw, _ = make_inputs(case, "cpu")
    gate = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    norm = norm_cls(case.G, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(nw)
        expected = norm(x.reshape(-1, case.G), gate.reshape(-1, case.G)).reshape(case.M, -1)
    assert torch.equal(naive_linear.gated_rmsnorm(x, F.silu(gate.float()), nw, EPS), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_normed_input_rounds_as_the_twin(device, dtype):
    """Through an identity projection (one split) each output is one normed input element times one:
    the kernel's normed, weighted and gated 16-bit input, rounded where the module rounds, against
    the twin element by element (another rsqrt may move an element across a rounding boundary: at
    most 1%; a rounding step left out moves about half of them)."""
    case = NormCase(M=5, heads=3, G=32, N=96, splits=1, dtype=dtype, seed=8)
    x, act, nw, _ = make_inputs(case, device)
    eye = torch.eye(96, dtype=dtype, device=device)
    got = gated_norm_linear_partials(x, act, nw, eye, 1, eps=EPS)[0].cpu()
    ref = naive_linear.gated_rmsnorm(x.cpu(), act.cpu(), nw.cpu(), EPS).float()
    differ = int((got != ref).sum())
    assert differ <= ref.numel() // 100, f"{differ} of {ref.numel()} normed elements differ from the twin"


def test_opcheck(device):
    case = NormCase(M=3, heads=4, G=16, N=20, splits=2, dtype=torch.float32, seed=4, gate_pad=24)
    x, act, nw, w = make_inputs(case, device)
    op = torch.ops.hybridspec.gated_norm_linear_partials.default
    torch.library.opcheck(op, (x, act, nw, w, 2, EPS))
    torch.library.opcheck(op, (x.bfloat16(), act, nw.bfloat16(), w.bfloat16(), 4, EPS))


def test_fits_gated():
    case = NormCase(M=3, heads=4, G=16, N=20, splits=4, dtype=torch.bfloat16, seed=5, gate_pad=24)
    x, act, nw, w = make_inputs(case, "cpu")
    assert fits_gated(x, act, nw, w, 4, EPS) == use_triton(x)
    for args in [
        (x, act[:, :32], nw, w, 4, EPS), (x, act.bfloat16(), nw, w, 4, EPS), (x, act, nw.float(), w, 4, EPS),
        (x, act, nw[:12], w, 4, EPS),  # not a power of two
        (x, act, torch.ones(32, dtype=x.dtype), w, 4, EPS),  # 64 columns in 4 splits of 16 cut the groups
        (x, act, nw, w, 0, EPS), (x, act.t().contiguous().t(), nw, w, 4, EPS), (x.float(), act, nw, w.float(), 4, EPS),
        (x, act, nw, w, 4, 0.0),
    ]:
        assert not fits_gated(*args)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x, g, n, w: (x, g[:, :32], n, w, 4), r"act must be fp32 shaped like x"),
        (lambda x, g, n, w: (x, g.half(), n, w, 4), r"act must be fp32 shaped like x"),
        (lambda x, g, n, w: (x, g.t().contiguous().t(), n, w, 4), r"act must be contiguous in its last dim"),
        (lambda x, g, n, w: (x, g, n.half(), w, 4), r"norm_weight must be a contiguous \[G\] tensor of x's dtype"),
        (lambda x, g, n, w: (x, g, n[:12], w, 4), r"the norm's group \(12\) must be a power of two"),
        (lambda x, g, n, w: (x, g, torch.ones(32), w, 4), r"dividing K \(64\) and each of 4 splits' span \(16\)"),
        (lambda x, g, n, w: (x, g, n, w, 17), r"splits must be an int in 1..16, got 17"),
        (lambda x, g, n, w: (x, g, n, w[:, :8], 4), r"weight must be \[N, K\] = \[N, 64\]"),
    ],
)
def test_wrapper_validates(change, match):
    case = NormCase(M=3, heads=4, G=16, N=20, splits=4, dtype=torch.float32, seed=6)
    x, act, nw, w = make_inputs(case, "cpu")
    with pytest.raises(ValueError, match=match):
        gated_norm_linear_partials(*change(x, act, nw, w), eps=EPS)
    with pytest.raises(ValueError, match=r"eps must be > 0, got 0.0"):
        gated_norm_linear_partials(x, act, nw, w, 4, eps=0.0)


# the 35B-A3B GDN mixer: 32 value heads of 128, out_proj 2048 x 4096, in 4 splits, at the round's rows
GPU_CASES = [NormCase(M=M, heads=32, G=128, N=2048, splits=4, dtype=dtype, seed=M, gate_pad=8192)
             for M in (1, 16, 64) for dtype in (torch.bfloat16, torch.float32)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"M{c.M}-{c.dtype}")
def test_real_shapes(case):
    check_case(case, "cuda")
    x, act, nw, w = make_inputs(case, "cuda")
    got = gated_norm_linear_partials(x, act, nw, w, 4, eps=EPS)
    assert torch.equal(got, gated_norm_linear_partials(x, act, nw, w, 4, eps=EPS))


@pytest.mark.parametrize("family_model", ["qwen35", "qwen3_next"])
def test_verification_with_the_norm_in_the_out_projection(device, monkeypatch, family_model):
    """A verified block with every GDN mixer's gated norm inside its output projection (one
    `gated_norm_linear_partials` launch per GDN layer, eager and compiled) gives the hidden states
    of the path that runs the norm module, and transformers' (fp32 tiny models); a hooked norm is
    left to its module."""
    from transformers import DynamicCache

    from hybridspec.patches import family_of
    from hybridspec.patches.forward import allocate_state, verify_forward
    from hybridspec.patches.fusion import fuse_model
    from tests.models import VOCAB, qwen3_next_causal_lm, qwen35_causal_lm

    build = qwen35_causal_lm if family_model == "qwen35" else qwen3_next_causal_lm
    model = build(seed=14).to(device)
    family = family_of(model)
    fuse_model(family, model)
    gdn_layers = family.text_config(model).layer_types.count("linear_attention")
    g = torch.Generator().manual_seed(15)
    prompt, block = (torch.randint(0, VOCAB, (1, n), generator=g).to(device) for n in (7, 5))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, use_cache=True, past_key_values=cache)
        state = allocate_state(family, model, cache, 32)
        monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", linear_ops.LinearKernelConfig(gated_out=0))
        with expect_launch("gated_norm_linear_partials", 0):
            plain, _ = verify_forward(family, model, block, state)
        monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", linear_ops.LinearKernelConfig(gated_out=1))
        with expect_launch("gated_norm_linear_partials", gdn_layers):
            got, _ = verify_forward(family, model, block, state)
        full = model(torch.cat([prompt, block], 1), output_hidden_states=True).hidden_states[-1][:, prompt.shape[1]:]
        mod = next(m for m in model.modules() if type(m) in family.GATED_NORMS)
        handle = mod.register_forward_hook(lambda *args: None)
        with expect_launch("gated_norm_linear_partials", gdn_layers - 1):
            hooked, _ = verify_forward(family, model, block, state)
        handle.remove()
    assert_rel(got.cpu(), plain.cpu(), 1e-5, "fused norm vs the module")
    assert_rel(got.cpu(), full.cpu(), 1e-5, "fused norm vs transformers")
    assert_rel(hooked.cpu(), full.cpu(), 1e-5, "hooked norm vs transformers")


def test_split_gated_out_projection_compiles(device):
    """Inside a fullgraph compile with a residual add after it, the same sums as eager."""
    from hybridspec.split_projection import split_gated_out_projection

    torch.manual_seed(16)
    norm = Qwen3_5MoeRMSNormGated(16, eps=EPS).to(device)
    lin = torch.nn.Linear(64, 24, bias=False).to(device)
    o, z = torch.randn(2, 3, 4, 16, device=device), torch.randn(2, 3, 4, 16, device=device)
    h = torch.randn(2, 3, 24, device=device)
    norms = (Qwen3_5MoeRMSNormGated,)
    with torch.no_grad():
        eager = split_gated_out_projection(norm, lin, o, z, norms)
        assert (eager is not None) == use_triton(o)
        if eager is None:
            return
        expected = lin(norm(o.reshape(-1, 16), z.reshape(-1, 16)).reshape(2, 3, 64))
        assert_rel(eager.cpu(), expected.cpu(), 1e-5, "vs the modules")
        compiled = torch.compile(lambda h, o, z: h + split_gated_out_projection(norm, lin, o, z, norms), fullgraph=True)
        assert_rel(compiled(h, o, z).cpu(), (h + eager).cpu(), 1e-6, "compiled")
        assert split_gated_out_projection(norm, lin, o, z, ()) is None
