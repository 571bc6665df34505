"""`gdn_conv_verify` (the GDN joint producer: conv, SiLU, gates and verify in one kernel) against
its naive twin, the unfused path's torch ops and the token-by-token recurrence."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridspec.ops import GDNFactors, gdn_commit, gdn_conv_verify, naive
from hybridspec.ops import naive_gdn_producer
from hybridspec.ops.gdn_producer import _gdn_conv_verify_op
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch

OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
FACTOR_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
W = 16


@dataclass(frozen=True)
class ProducerCase:
    B: int
    T: int
    HK: int
    group: int
    K: int
    V: int
    KW: int
    bias: bool
    dtype: torch.dtype
    seed: int

    @property
    def HV(self) -> int:
        return self.HK * self.group

    @property
    def C(self) -> int:
        return 2 * self.HK * self.K + self.HV * self.V


def producer_cases(head_dims=(16, 32), max_batch=2):
    return st.builds(
        ProducerCase, B=st.integers(1, max_batch), T=st.integers(1, 16), HK=st.sampled_from([1, 2]),
        group=st.sampled_from([1, 2]), K=st.sampled_from(head_dims), V=st.sampled_from(head_dims),
        KW=st.sampled_from([2, 4]), bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
        seed=st.integers(0, 2**31 - 1),
    )


def make_inputs(case: ProducerCase, device: str, strided: bool = False) -> dict:
    """The op's inputs; `strided`: `mixed`, `a` and `b` as views of one wider projection output, as
    Qwen3.5's fused input projection gives them."""
    gen = torch.Generator().manual_seed(case.seed)
    B, T, C, HV = case.B, case.T, case.C, case.HV

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(case.dtype).to(device)

    if strided:
        wide = randn(B, T, C + 2 * HV + 3)
        mixed, a, b = wide[..., :C], wide[..., C : C + HV], wide[..., C + HV : C + 2 * HV]
    else:
        mixed, a, b = randn(B, T, C), randn(B, T, HV), randn(B, T, HV)
    return dict(
        mixed=mixed, a=a, b=b, window=randn(B, C, case.KW), conv_weight=randn(C, case.KW, scale=0.5),
        conv_bias=randn(C, scale=0.1) if case.bias else None,
        # A_log fp32 as transformers keeps it; dt_bias in the model dtype
        A_log=torch.log(torch.rand(HV, generator=gen) * 8 + 0.5).to(device), dt_bias=randn(HV),
        state=torch.randn(B, HV, case.K, case.V, generator=gen).to(device),
    )


def buffers(case: ProducerCase, device: str):
    factors = GDNFactors(
        torch.full((case.B, case.T, case.HV, case.V), float("nan"), device=device),
        torch.full((case.B, case.T, case.HK, case.K), float("nan"), device=device),
        torch.full((case.B, case.T, case.HV), float("nan"), device=device),
    )
    return factors, torch.full((case.B, case.C, W), float("nan"), dtype=case.dtype, device=device)


def unfused(case: ProducerCase, x: dict, num_tokens=None):
    """The verification forward's unfused ops (the conv, SiLU and gates as torch ops, then the
    naive verify), on the CPU in fp32 where the inputs are: the oracle."""
    HK, K, HV, V = case.HK, case.K, case.HV, case.V
    cpu = {k: (v.cpu() if v is not None else None) for k, v in x.items()}
    conv = naive_gdn_producer.causal_conv(cpu["window"], cpu["mixed"].transpose(1, 2), cpu["conv_weight"], cpu["conv_bias"])
    act = F.silu(conv).transpose(1, 2)
    q, k, v = torch.split(act, [HK * K, HK * K, HV * V], dim=-1)
    g = -cpu["A_log"].float().exp() * F.softplus(cpu["a"].float() + cpu["dt_bias"])
    beta = cpu["b"].sigmoid()
    B, T = case.B, case.T
    return naive.recurrent_states(q.reshape(B, T, HK, K).float(), k.reshape(B, T, HK, K).float(),
                                  v.reshape(B, T, HV, V).float(), g, beta.float(), cpu["state"],
                                  num_tokens=None if num_tokens is None else num_tokens.cpu())


def run(case, x, device, num_tokens=None):
    factors, inputs = buffers(case, device)
    o, f = gdn_conv_verify(x["mixed"], x["a"], x["b"], x["window"], x["conv_weight"], x["conv_bias"], x["A_log"],
                           x["dt_bias"], x["state"], key_heads=case.HK, num_tokens=num_tokens, factors_out=factors,
                           inputs_out=inputs)
    return o, f, inputs


def _check(case, device, n, m, strided):
    x = make_inputs(case, device, strided)
    nt = None if n is None else torch.tensor(n, device=device, dtype=torch.int32)
    with expect_launch("gdn_conv_verify"):
        o, f, inputs = run(case, x, device, nt)
    ref_o, ref_z, ref_k, ref_g, ref_states = unfused(case, x, nt)
    assert o.dtype == case.dtype
    valid = torch.ones(case.B, case.T, dtype=torch.bool) if n is None else torch.arange(case.T)[None] < torch.tensor(n)[:, None]
    assert_rel(o.float().cpu()[valid], ref_o[valid], OUT_TOL[case.dtype], "o")
    assert_rel(f.z.cpu()[valid], ref_z[valid], FACTOR_TOL[case.dtype], "z")
    assert_rel(f.k.cpu()[valid], ref_k[valid], FACTOR_TOL[case.dtype], "k")
    assert_rel(f.g_cum.cpu(), ref_g, 1e-5, "g_cum")
    # the raw inputs the commit reads, bit for bit; columns past T untouched
    assert torch.equal(inputs[:, :, : case.T].cpu(), x["mixed"].transpose(1, 2).cpu())
    assert inputs[:, :, case.T :].isnan().all()
    # committing any prefix gives the recurrence's state after it
    states = x["state"][None].clone()
    gdn_commit(states, GDNFactors(*(t[None] for t in f)), torch.tensor(m, device=device))
    expected = torch.stack([x["state"][b].cpu() if m[b] == 0 else ref_states[b, m[b] - 1] for b in range(case.B)])
    assert_rel(states[0].cpu(), expected, FACTOR_TOL[case.dtype], "committed state")


@settings(max_examples=30, deadline=None)
@given(case=producer_cases(), data=st.data())
def test_conv_verify_matches_unfused_ops(device, case, data):
    n = data.draw(st.one_of(st.none(), st.lists(st.integers(1, case.T), min_size=case.B, max_size=case.B)), label="n")
    m = [data.draw(st.integers(0, case.T if n is None else n[b]), label="m") for b in range(case.B)]
    _check(case, device, n, m, strided=data.draw(st.booleans(), label="strided"))


@pytest.mark.gpu
@settings(max_examples=15, deadline=None)
@given(case=producer_cases(head_dims=(128,)), data=st.data())
def test_conv_verify_qwen_head_dim(case, data):
    n = data.draw(st.lists(st.integers(1, case.T), min_size=case.B, max_size=case.B), label="n")
    m = [data.draw(st.integers(0, x)) for x in n]
    _check(case, "cuda", n, m, strided=True)


@settings(max_examples=6, deadline=None)
@given(case=producer_cases(), poison=st.sampled_from(["nan", "inf"]), data=st.data())
def test_rows_past_num_tokens_change_nothing(device, case, poison, data):
    """Rows at or past a row's count may hold anything (the graph's padding rows): the counted rows'
    outputs and factors do not change. Row t's conv reads rows <= t only."""
    n = data.draw(st.lists(st.integers(1, case.T), min_size=case.B, max_size=case.B), label="n")
    x = make_inputs(case, device)
    nt = torch.tensor(n, device=device)
    past = torch.arange(case.T, device=device)[None, :] >= nt[:, None]
    clean_o, clean_f, _ = run(case, x, device, nt)
    dirty = dict(x)
    for name in ("mixed", "a", "b"):
        dirty[name] = torch.where(past[..., None], torch.full_like(x[name], float(poison)), x[name])
    dirty_o, dirty_f, _ = run(case, dirty, device, nt)
    keep = ~past
    assert torch.equal(clean_o[keep], dirty_o[keep])
    for a, b in zip(clean_f, dirty_f):
        assert torch.equal(a[keep], b[keep])


def test_naive_twin_matches_unfused_ops():
    """The op's CPU body (no kernel: the twin) against the unfused ops."""
    case = ProducerCase(B=2, T=5, HK=2, group=2, K=16, V=32, KW=4, bias=True, dtype=torch.float32, seed=3)
    x = make_inputs(case, "cpu")
    factors, inputs = buffers(case, "cpu")
    o_ref, z, kn, g_cum = naive_gdn_producer.gdn_conv_verify(
        x["mixed"], x["a"], x["b"], x["window"], x["conv_weight"], x["conv_bias"], x["A_log"], x["dt_bias"], x["state"],
        (case.HK, case.K, case.HV, case.V))
    ref = unfused(case, x)
    assert_rel(o_ref, ref[0], 1e-6, "o")
    assert_rel(z, ref[1], 1e-6, "z")


def test_wrapper_rejects_bad_inputs():
    case = ProducerCase(B=1, T=3, HK=1, group=2, K=16, V=16, KW=4, bias=False, dtype=torch.float32, seed=4)
    x = make_inputs(case, "cpu")
    factors, inputs = buffers(case, "cpu")
    args = dict(key_heads=1, factors_out=factors, inputs_out=inputs)
    with pytest.raises(ValueError, match="channels"):
        gdn_conv_verify(x["mixed"][..., :-16], x["a"], x["b"], x["window"][:, :-16], x["conv_weight"][:-16],
                        None, x["A_log"], x["dt_bias"], x["state"], **args)
    with pytest.raises(ValueError, match="conv_weight"):
        gdn_conv_verify(x["mixed"], x["a"], x["b"], x["window"], x["conv_weight"].to(torch.bfloat16), None,
                        x["A_log"], x["dt_bias"], x["state"], **args)
    with pytest.raises(ValueError, match="inputs_out"):
        gdn_conv_verify(x["mixed"], x["a"], x["b"], x["window"], x["conv_weight"], None, x["A_log"], x["dt_bias"],
                        x["state"], key_heads=1, factors_out=factors, inputs_out=inputs[:, :, :2])


def test_opcheck(device):
    case = ProducerCase(B=2, T=3, HK=1, group=2, K=16, V=16, KW=4, bias=True, dtype=torch.float32, seed=5)
    x = make_inputs(case, device)
    factors, inputs = buffers(case, device)
    nt = torch.tensor([3, 2], device=device)
    torch.library.opcheck(_gdn_conv_verify_op, (
        x["mixed"], x["a"], x["b"], x["window"], x["conv_weight"], x["conv_bias"], x["A_log"], x["dt_bias"], x["state"],
        nt, *factors, inputs, 0.25, True))


@pytest.mark.parametrize("family_model", ["qwen35", "qwen3_next"])
def test_verified_block_with_the_producer(device, monkeypatch, family_model):
    """A verified block of both tiny families with the joint producer (one `gdn_conv_verify`
    launch per GDN layer, no `gdn_verify`) gives the unfused path's hidden states and
    transformers', and writes the conv inputs the commit reads as the unfused path does."""
    from transformers import DynamicCache

    from hybridspec.ops import gdn_producer
    from hybridspec.patches import family_of
    from hybridspec.patches.forward import allocate_state, verify_forward
    from hybridspec.patches.fusion import fuse_model
    from tests.models import VOCAB, qwen3_next_causal_lm, qwen35_causal_lm

    build = qwen35_causal_lm if family_model == "qwen35" else qwen3_next_causal_lm
    model = build(seed=21).to(device)
    family = family_of(model)
    fuse_model(family, model)
    gdn_layers = family.text_config(model).layer_types.count("linear_attention")
    g = torch.Generator().manual_seed(22)
    prompt, block = (torch.randint(0, VOCAB, (1, n), generator=g).to(device) for n in (7, 5))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, use_cache=True, past_key_values=cache)
        state = allocate_state(family, model, cache, 32)
        monkeypatch.setattr(gdn_producer, "KERNEL_CONFIG", gdn_producer.GDNKernelConfig(fuse_producer=False))
        plain, _ = verify_forward(family, model, block, state)
        plain_inputs = state.conv_inputs[..., : block.shape[1]].clone()
        state.conv_inputs.fill_(float("nan"))
        monkeypatch.setattr(gdn_producer, "KERNEL_CONFIG", gdn_producer.GDNKernelConfig(fuse_producer=True))
        with expect_launch("gdn_conv_verify", gdn_layers), expect_launch("gdn_verify", 0):
            got, _ = verify_forward(family, model, block, state)
        full = model(torch.cat([prompt, block], 1), output_hidden_states=True).hidden_states[-1][:, prompt.shape[1]:]
    # the first GDN layer's inputs come from the same embedding and projection: the same bits; the
    # later layers' from hidden states that differ in rounding
    got_inputs = state.conv_inputs[..., : block.shape[1]]
    assert torch.equal(got_inputs[0], plain_inputs[0])
    assert_rel(got_inputs.cpu(), plain_inputs.cpu(), 1e-5, "conv inputs")
    assert_rel(got.cpu(), plain.cpu(), 1e-5, "producer vs unfused")
    assert_rel(got.cpu(), full.cpu(), 1e-5, "producer vs transformers")
