"""`gdn_verify_gated` (one-row verify + the mixer's gated RMSNorm in one kernel) against its twin:
the recurrence's output through transformers' `RMSNormGated` formula (`naive.gated_rms_norm`)."""

import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNormGated

from hybridspec.ops import gdn as gdn_mod
from hybridspec.ops import gdn_verify_gated, gdn_verify_packed, naive
from hybridspec.ops.gdn_gated import _round_product, gated_block_k
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch
from tests.ops.gdn_inputs import GDNCase, gdn_cases, make_inputs

STATE_TOL = 1e-5
# bf16: the output passes four roundings (o, the normalised row, the weight product, the result);
# Triton's interpreter converts fp32 to bf16 by truncation where the GPU rounds to nearest even, so
# each can be an ulp (2^-8) off on the CPU. The CUDA test below checks the bits.
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-6


@st.composite
def gated_inputs(draw):
    """A T = 1 case, its `num_tokens` (None, or 0 or 1 per batch row), l2norm on or off, and the
    norm weight's dtype (the input's, or fp32)."""
    case = dataclasses.replace(draw(gdn_cases(head_dims=(16, 32), max_batch=3)), T=1)
    n = draw(st.none() | st.lists(st.integers(0, 1), min_size=case.B, max_size=case.B))
    weight_dtype = draw(st.sampled_from([case.dtype, torch.float32]))
    return case, n, draw(st.booleans()), weight_dtype


def _case(B, HK, group, K, V, dtype, seed):
    return GDNCase(B=B, T=1, HK=HK, group=group, K=K, V=V, dtype=dtype, decay="mixed", gate="random", seed=seed)


EXAMPLES = [
    (_case(3, 2, 2, 32, 16, torch.bfloat16, 1), [1, 0, 1], True, torch.bfloat16),
    (_case(2, 1, 4, 16, 32, torch.float32, 2), None, False, torch.float32),
    (_case(1, 2, 2, 64, 64, torch.bfloat16, 3), [1], True, torch.float32),
]


def _gated_round(case: GDNCase, device: str, n, l2norm: bool, weight_dtype):
    """The op on one row (inputs past `n` poisoned with NaN, the gate included, and the gate a
    strided view as the mixer's projection split gives it) and the reference: the twin's fp32
    output rounded to the input dtype, then the norm."""
    q, k, v, g, beta, state = make_inputs(case, device)
    gen = torch.Generator().manual_seed(case.seed + 1)
    B, HV, V = case.B, case.HV, case.V
    wide = torch.randn(B, 1, HV, 2 * V, generator=gen).to(case.dtype).to(device)
    gate = wide[..., V:]  # strides (2 HV V, 2 HV V, 2 V, 1)
    weight = (1 + 0.2 * torch.randn(V, generator=gen)).to(weight_dtype).to(device)
    nt = None if n is None else torch.tensor(n, device=device, dtype=torch.int32)
    if nt is not None:
        past = nt == 0
        q, k, v, g, beta, gate = (
            torch.where(past.view(-1, *([1] * (x.dim() - 1))), torch.full_like(x, float("nan")), x)
            for x in (q, k, v, g, beta, gate)
        )
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    with expect_launch("gdn_verify_gated"):
        out, f = gdn_verify_gated(qkv, g, beta, state, gate, weight, EPS, num_k_heads=case.HK, head_k_dim=case.K,
                                  head_v_dim=V, num_tokens=nt, use_qk_l2norm=l2norm)
    cpu = [x.float().cpu() for x in (q, k, v, g, beta, state)]
    o, z, kn, g_cum = naive.gdn_verify(*cpu, use_qk_l2norm=l2norm, num_tokens=None if nt is None else nt.cpu())
    ref = naive.gated_rms_norm(o.to(case.dtype), gate.cpu(), weight.cpu(), EPS)
    return out, f, (ref, z, kn, g_cum)


@settings(max_examples=12)
@given(args=gated_inputs())
@example(args=EXAMPLES[0])
@example(args=EXAMPLES[1])
@example(args=EXAMPLES[2])
def test_gated_verify_matches_recurrence_and_norm(device, args):
    """Output and factors against the twin; a row past `num_tokens` gives zeros in every output
    although its inputs and gate are NaN."""
    case, n, l2norm, weight_dtype = args
    out, f, (ref, ref_z, ref_k, ref_g) = _gated_round(case, device, n, l2norm, weight_dtype)
    assert out.dtype == case.dtype and out.shape == (case.B, 1, case.HV, case.V)
    valid = [b for b in range(case.B) if n is None or n[b] == 1]
    if valid:
        assert_rel(out[valid].float().cpu(), ref[valid].float(), OUT_TOL[case.dtype], "out")
    assert_rel(f.z.cpu(), ref_z, STATE_TOL, "z")
    assert_rel(f.k.cpu(), ref_k, STATE_TOL, "k")
    assert_rel(f.g_cum.cpu(), ref_g, STATE_TOL, "g_cum")
    for b in set(range(case.B)) - set(valid):
        assert all(torch.equal(x[b], torch.zeros_like(x[b])) for x in (out, *f)), f"row past n in batch {b}"


def test_twin_norm_is_the_transformers_module():
    """`naive.gated_rms_norm` gives `Qwen3_5MoeRMSNormGated`'s bits, in bf16 and fp32."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        norm = Qwen3_5MoeRMSNormGated(64, eps=EPS).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(64, generator=gen))
        x, gate = (torch.randn(5, 64, generator=gen).to(dtype) for _ in range(2))
        assert torch.equal(naive.gated_rms_norm(x, gate, norm.weight, EPS), norm(x, gate))


def test_block_k_is_a_power_of_two_within_the_head():
    assert gated_block_k(128) == 32 and gated_block_k(16) == 16
    for bk, want in ((48, 32), (8, 16), (256, 128), (100, 64)):
        assert gated_block_k(128, {**gdn_mod.VERIFY_CONFIG, "gated_BK": bk}) == want


def test_only_the_plain_module_counts_as_its_norm():
    """`plain_gated_norm`: the transformers class with its own forward, no instance forward, no
    hooks and a silu gate; anything else keeps the module call (a kernelized norm computes fla's
    rounding, a hook may change the output)."""
    from hybridspec.patches import qwen3_5_moe
    from hybridspec.patches.common import plain_gated_norm

    cls, forward = qwen3_5_moe.GATED_NORM

    def norm():
        return cls(16, eps=EPS)

    assert plain_gated_norm(norm(), cls, forward)
    hooked = norm()
    hooked.register_forward_hook(lambda *a: None)
    patched = norm()
    patched.forward = lambda x, gate: x
    other = norm()
    other.activation = "gelu"
    for module in (hooked, patched, other):
        assert not plain_gated_norm(module, cls, forward)
    assert not plain_gated_norm(type("Sub", (cls,), {})(16), cls, forward)
    assert not plain_gated_norm(norm(), cls, lambda self, x, gate: x)  # the class's forward swapped


def test_round_product_follows_torch_promotion():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert _round_product(bf16, bf16) and _round_product(fp16, fp16)
    assert not _round_product(fp32, bf16) and not _round_product(bf16, fp16) and not _round_product(bf16, fp32)
    assert not _round_product(fp32, fp32)


def _small(device, T=1):
    case = GDNCase(B=1, T=T, HK=1, group=2, K=16, V=16, dtype=torch.float32, decay="moderate", gate="random", seed=3)
    q, k, v, g, beta, state = make_inputs(case, device)
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    gate = torch.randn(1, T, 2, 16, device=device)
    return qkv, g, beta, state, gate, torch.ones(16, device=device)


def test_rejects_what_it_cannot_take(device):
    qkv, g, beta, state, gate, weight = _small(device, T=2)
    kw = dict(num_k_heads=1, head_k_dim=16, head_v_dim=16)
    with pytest.raises(ValueError, match="one row"):
        gdn_verify_gated(qkv, g, beta, state, gate, weight, EPS, **kw)
    qkv, g, beta, state, gate, weight = _small(device)
    with pytest.raises(ValueError, match="gate must be"):
        gdn_verify_gated(qkv, g, beta, state, gate[..., :8], weight, EPS, **kw)
    with pytest.raises(ValueError, match="gate must be"):
        gdn_verify_gated(qkv, g, beta, state, gate.transpose(2, 3), weight, EPS, **kw)
    with pytest.raises(ValueError, match="norm_weight must be"):
        gdn_verify_gated(qkv, g, beta, state, gate, weight[:8], EPS, **kw)
    with pytest.raises(ValueError, match="norm_weight must be fp32, bf16 or fp16"):
        gdn_verify_gated(qkv, g, beta, state, gate, weight.double(), EPS, **kw)
    with pytest.raises(ValueError, match="g and beta must be"):
        gdn_verify_gated(qkv[..., :-16], g, beta, state, gate, weight, EPS, **kw)


def test_opcheck(device):
    qkv, g, beta, state, gate, weight = _small(device)
    z, kn, gc = (torch.empty(1, 1, 2, 16, device=device), torch.empty(1, 1, 1, 16, device=device),
                 torch.empty(1, 1, 2, device=device))
    torch.library.opcheck(
        torch.ops.hybridspec.gdn_verify_gated.default,
        (qkv, g, beta, state, torch.tensor([1], device=device), gate, weight, z, kn, gc, 1, 16, 16, 0.25, True, EPS),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("n", [None, [1], [0]], ids=["all", "n1", "n0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_verify_qwen_shape_cuda(n, dtype):
    """The AR step at the 35B-A3B shape (B = 1, 16 key and 32 value heads of 128) with the model's
    dtypes, the kernel at its launch configuration."""
    case = _case(1, 16, 2, 128, 128, dtype, 5)
    out, f, (ref, ref_z, ref_k, ref_g) = _gated_round(case, "cuda", n, True, dtype)
    if n == [0]:
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert_rel(out.float().cpu(), ref.float(), OUT_TOL[dtype], "out")
    for name, got, want in zip(("z", "k", "g_cum"), f, (ref_z, ref_k, ref_g)):
        assert_rel(got.cpu(), want, STATE_TOL, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                 (torch.float16, torch.float16), (torch.float16, torch.float32)])
def test_gated_epilogue_rounds_as_the_module_cuda(dtype, weight_dtype):
    """In 16 bits the epilogue gives the module's bits on the one-row verify's own output (the same
    fp32 sums as the one-row path of `gdn_verify_packed`), with the weight in the input's dtype (its
    product rounded) or in fp32 (not): only the variance's summation order may differ from torch's,
    so almost no element may differ. Where it does, the normalised value's rounding to the input
    dtype flipped (one ulp of that intermediate), and the weight and gate products carry the flip to
    the output: at most two ulps of the output, counted in the output dtype's own spacing (subnormals
    included: an fp16 run on an H100 on 2026-12-07 failed a bound of |want| x 2^-10, which is below
    one ulp there)."""
    case = _case(1, 16, 2, 128, 128, dtype, 7)
    q, k, v, g, beta, state = make_inputs(case, "cuda")
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    gen = torch.Generator().manual_seed(8)
    gate = torch.randn(1, 1, case.HV, case.V, generator=gen).to(dtype).cuda()
    norm = Qwen3_5MoeRMSNormGated(case.V, eps=EPS).to(weight_dtype).cuda()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(case.V, generator=gen))
    kw = dict(num_k_heads=case.HK, head_k_dim=case.K, head_v_dim=case.V)
    with torch.no_grad():
        out, _ = gdn_verify_gated(qkv, g, beta, state, gate, norm.weight, EPS, **kw)
        with mock.patch.dict(gdn_mod.VERIFY_CONFIG, {"one_row": 1}):
            o, _ = gdn_verify_packed(qkv, g, beta, state, **kw)
        want = norm(o, gate)
    differ = out != want
    assert differ.float().mean().item() < 0.01, f"{int(differ.sum())} of {out.numel()} elements differ"
    ulps = (out.float() - want.float()).abs() / _ulp(want)
    assert ulps.max().item() <= 2, f"{int((ulps > 2).sum())} elements differ by more than two ulps (at most {ulps.max().item()})"


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of x's dtype at each element of x, as fp32 (the subnormal spacing below the
    smallest normal)."""
    info = torch.finfo(x.dtype)
    exponent = torch.frexp(x.float().abs().clamp_min(info.tiny))[1] - 1
    # eps is the spacing at 1.0: 2^-(the dtype's mantissa bits)
    return torch.exp2(exponent.float()) * info.eps
