"""attention_prologue's kernel against its naive twin (hybridspec.ops.naive_prologue), and the naive
twin against the transformers modules it stands for (the families' RMSNorm and
`apply_rotary_pos_emb`, then the KV write the attention layer did by `index_put`)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import attention_prologue, naive_prologue
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch

# 16-bit: one rounding of the norm's output can differ (the fp32 sum of squares in another order),
# and the rotary sum carries it
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass(frozen=True)
class Case:
    B: int
    W: int
    G: int
    Hkv: int
    D: int
    R: int  # rotary dims
    S: int
    lengths: tuple[int, ...]
    dtype: torch.dtype
    seed: int
    offset: float = 1.0


def make_inputs(case: Case, device: str):
    """q, k, v as views of one fused projection output (q beside its gate, as Qwen3.5's q_proj
    lays them out), norm weights, cos / sin, NaN-filled KV buffers and lengths."""
    gen = torch.Generator().manual_seed(case.seed)
    B, W, Hq, Hkv, D, S = case.B, case.W, case.G * case.Hkv, case.Hkv, case.D, case.S
    proj = torch.randn(B, W, Hq * 2 * D + 2 * Hkv * D, generator=gen) * 2
    qw, kw = torch.randn(2, D, generator=gen) * 0.3
    angles = torch.rand(B, W, case.R // 2, generator=gen) * 6.0
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    keys = torch.full((B, Hkv, S, D), float("nan"))
    values = torch.full((B, Hkv, S, D), float("nan"))
    lengths = torch.tensor(case.lengths)
    dt, dev = case.dtype, device
    # the views survive the cast: cast the whole projection, then slice it again
    proj = proj.to(dt).to(dev)
    qg = proj[..., : Hq * 2 * D].reshape(B, W, Hq, 2 * D)
    q, k, v = (qg[..., :D], proj[..., Hq * 2 * D : Hq * 2 * D + Hkv * D].reshape(B, W, Hkv, D),
               proj[..., Hq * 2 * D + Hkv * D :].reshape(B, W, Hkv, D))
    return (q, k, v, qw.to(dev), kw.to(dev), cos.to(dt).to(dev), sin.to(dt).to(dev), keys.to(dt).to(dev),
            values.to(dt).to(dev), lengths.to(dev))


@st.composite
def cases(draw):
    B = draw(st.integers(1, 2), label="B")
    W = draw(st.sampled_from([1, 3, 16]), label="W")
    D = draw(st.sampled_from([16, 24, 32]), label="D")
    R = draw(st.sampled_from([r for r in (4, 8, 16, D) if r <= D]), label="R")
    S = draw(st.integers(W, 40), label="S")
    n = draw(st.sampled_from([1, B]), label="lengths")
    lengths = tuple(draw(st.integers(0, S - W), label=f"L{b}") for b in range(n))
    return Case(B, W, draw(st.sampled_from([1, 2, 4]), label="G"), draw(st.integers(1, 2), label="Hkv"), D, R, S,
                lengths, draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), label="dtype"),
                draw(st.integers(0, 2**16), label="seed"), draw(st.sampled_from([1.0, 0.0]), label="offset"))


def _both(case: Case, device: str):
    args = make_inputs(case, device)
    q, k, v, qw, kw, cos, sin, keys, values, lengths = args
    ref_keys, ref_values = keys.cpu().clone(), values.cpu().clone()
    ref = naive_prologue.attention_prologue(*(t.cpu() for t in (q, k, v, qw, kw)), 1e-6, case.offset, cos.cpu(),
                                            sin.cpu(), ref_keys, ref_values, lengths.cpu())
    with expect_launch("attention_prologue"):
        out = attention_prologue(q, k, v, qw, kw, cos, sin, keys, values, lengths, eps=1e-6, offset=case.offset)
    return (out, keys, values), (ref, ref_keys, ref_values)


@settings(max_examples=12)
@given(case=cases())
@example(case=Case(B=1, W=1, G=8, Hkv=2, D=32, R=8, S=20, lengths=(19,), dtype=torch.bfloat16, seed=0))
@example(case=Case(B=2, W=16, G=2, Hkv=1, D=24, R=24, S=40, lengths=(3, 24), dtype=torch.float32, seed=1))
def test_matches_naive(device, case):
    (out, keys, values), (ref, ref_keys, ref_values) = _both(case, device)
    assert out.shape == ref.shape and out.dtype == case.dtype and out.is_contiguous()
    tol = TOL[case.dtype]
    assert_rel(out.cpu().float(), ref.float(), tol, "q")
    written = ~torch.isnan(ref_keys)
    # the kernel writes exactly the rows the twin writes, and nothing else
    assert torch.equal(~torch.isnan(keys.cpu()), written)
    assert torch.equal(~torch.isnan(values.cpu()), ~torch.isnan(ref_values))
    assert_rel(keys.cpu()[written].float(), ref_keys[written].float(), tol, "keys")
    # values are copied, not computed
    assert torch.equal(values.cpu()[written], ref_values[written])


def test_one_length_for_every_row(device):
    case = Case(B=2, W=3, G=2, Hkv=2, D=16, R=8, S=12, lengths=(5,), dtype=torch.float32, seed=4)
    q, k, v, qw, kw, cos, sin, keys, values, lengths = make_inputs(case, device)
    keys2, values2 = keys.clone(), values.clone()
    out = attention_prologue(q, k, v, qw, kw, cos, sin, keys, values, lengths, eps=1e-6)
    out2 = attention_prologue(q, k, v, qw, kw, cos, sin, keys2, values2, lengths.expand(2).clone(), eps=1e-6)
    assert torch.equal(out, out2)
    assert torch.equal(keys.nan_to_num(7.0), keys2.nan_to_num(7.0))
    assert torch.equal(values.nan_to_num(7.0), values2.nan_to_num(7.0))


def test_cos_sin_broadcast_over_the_batch(device):
    """One position row for every sequence (`[1, w, R]`) reads like the same row repeated."""
    case = Case(B=2, W=2, G=1, Hkv=1, D=16, R=16, S=8, lengths=(2, 4), dtype=torch.float32, seed=5)
    q, k, v, qw, kw, cos, sin, keys, values, lengths = make_inputs(case, device)
    keys2, values2 = keys.clone(), values.clone()
    out = attention_prologue(q, k, v, qw, kw, cos[:1], sin[:1], keys, values, lengths, eps=1e-6)
    rep = lambda t: t[:1].expand(2, -1, -1).contiguous()  # noqa: E731
    out2 = attention_prologue(q, k, v, qw, kw, rep(cos), rep(sin), keys2, values2, lengths, eps=1e-6)
    assert torch.equal(out, out2)
    assert torch.equal(keys.nan_to_num(7.0), keys2.nan_to_num(7.0))


def test_opcheck(device):
    case = Case(B=1, W=2, G=2, Hkv=1, D=16, R=8, S=6, lengths=(3,), dtype=torch.float32, seed=6)
    q, k, v, qw, kw, cos, sin, keys, values, lengths = make_inputs(case, device)
    keys, values = keys.nan_to_num(0.0), values.nan_to_num(0.0)
    torch.library.opcheck(torch.ops.hybridspec.attention_prologue.default,
                          (q, k, v, qw, kw, 1e-6, 1.0, cos, sin, keys, values, lengths))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_naive_is_the_transformers_modules(family, dtype):
    """The twin is bit for bit what the attention layer computed with transformers' own norm and
    rotary function, then the `index_put` writes (`patches/common.py` before this op)."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm_cls = {"qwen3_5_moe": "Qwen3_5MoeRMSNorm", "qwen3_next": "Qwen3NextRMSNorm"}[family]
    case = Case(B=2, W=3, G=4, Hkv=2, D=32, R=8, S=10, lengths=(2, 6), dtype=dtype, seed=7)
    q, k, v, qw, kw, cos, sin, keys, values, lengths = make_inputs(case, "cpu")
    q_norm, k_norm = getattr(modeling, norm_cls)(32, eps=1e-6), getattr(modeling, norm_cls)(32, eps=1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(qw)
        k_norm.weight.copy_(kw)
        qt, kt = modeling.apply_rotary_pos_emb(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin)
    ref_keys, ref_values = keys.clone(), values.clone()
    rows = lengths[:, None] + torch.arange(3)
    batch = torch.arange(2)[:, None]
    ref_keys[batch, :, rows] = kt.transpose(1, 2)
    ref_values[batch, :, rows] = v
    out = naive_prologue.attention_prologue(q, k, v, qw, kw, 1e-6, 1.0, cos, sin, keys, values, lengths)
    assert torch.equal(out, qt.transpose(1, 2))
    assert torch.equal(keys.nan_to_num(7.0), ref_keys.nan_to_num(7.0))
    assert torch.equal(values.nan_to_num(7.0), ref_values.nan_to_num(7.0))


def test_bad_inputs_say_what_is_wrong():
    case = Case(B=1, W=2, G=2, Hkv=1, D=16, R=8, S=6, lengths=(3,), dtype=torch.float32, seed=8)
    q, k, v, qw, kw, cos, sin, keys, values, lengths = make_inputs(case, "cpu")
    with pytest.raises(ValueError, match="rotary dim"):
        attention_prologue(q, k, v, qw, kw, cos[..., :3], sin[..., :3], keys, values, lengths, eps=1e-6)
    with pytest.raises(ValueError, match="multiple of key heads"):
        attention_prologue(q[:, :, :1], k.expand(-1, -1, 2, -1), v.expand(-1, -1, 2, -1), qw, kw, cos, sin,
                           keys, values, lengths, eps=1e-6)
    with pytest.raises(ValueError, match="k must have q's dtype"):
        attention_prologue(q, k.half(), v, qw, kw, cos, sin, keys, values, lengths, eps=1e-6)
    with pytest.raises(ValueError, match="q_weight"):
        attention_prologue(q, k, v, qw[:8], kw, cos, sin, keys, values, lengths, eps=1e-6)
    with pytest.raises(ValueError, match="share a dtype"):
        attention_prologue(q, k, v, qw, kw.half(), cos, sin, keys, values, lengths, eps=1e-6)


def test_only_the_plain_modules_take_the_fused_prologue(monkeypatch):
    """`plain_norm` / `fused_prologue`: the family's norm class with its own forward and no hooks,
    one eps for both norms, and the config on; anything else keeps the module calls."""
    from types import SimpleNamespace

    from hybridspec.ops import prologue
    from hybridspec.patches import qwen3_5_moe
    from hybridspec.patches.common import fused_prologue, plain_norm

    cls, forward = qwen3_5_moe.QK_NORM
    cos = torch.zeros(1, 1, 8)
    monkeypatch.setitem(prologue.PROLOGUE_CONFIG, "fused", 1)

    def attn(**changes):
        mod = SimpleNamespace(q_norm=cls(16), k_norm=cls(16), head_dim=16)
        for name, value in changes.items():
            setattr(mod, name, value)
        return mod

    assert plain_norm(cls(16), cls, forward) and fused_prologue(attn(), qwen3_5_moe.QK_NORM, cos)
    hooked = cls(16)
    hooked.register_forward_pre_hook(lambda *a: None)
    patched = cls(16)
    patched.forward = lambda x: x
    for mod in (attn(q_norm=hooked), attn(k_norm=patched), attn(k_norm=cls(16, eps=1e-5)), attn(k_norm=cls(16).half())):
        assert not fused_prologue(mod, qwen3_5_moe.QK_NORM, cos)
    assert not fused_prologue(attn(), None, cos)
    assert not fused_prologue(attn(head_dim=4), qwen3_5_moe.QK_NORM, cos)
    assert not plain_norm(cls(16), cls, lambda self, x: x)
    monkeypatch.setitem(prologue.PROLOGUE_CONFIG, "fused", 0)
    assert not fused_prologue(attn(), qwen3_5_moe.QK_NORM, cos)
