"""The op wrappers without the Triton interpreter: validation messages and the naive twin on CPU."""

import pytest
import torch

from hybridspec.ops import GDNFactors, decode_attention, gdn_commit, gdn_verify, lm_head_top1
from hybridspec.ops.dispatch import launch_counts
from tests.helpers import assert_rel
from tests.ops.gdn_inputs import GDNCase, make_inputs

CASE = GDNCase(B=2, T=6, HK=2, group=2, K=16, V=32, dtype=torch.float32, decay="mixed", gate="random", seed=1)


def test_cpu_without_interpreter_runs_naive_twin_matching_transformers():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, state = make_inputs(CASE, "cpu")
    before = sum(launch_counts.values())
    o, f = gdn_verify(q, k, v, g, beta, state)
    states = state[None].clone()
    gdn_commit(states, GDNFactors(*(x[None] for x in f)), torch.tensor([CASE.T, CASE.T]))
    assert sum(launch_counts.values()) == before, "no Triton launch expected on CPU without TRITON_INTERPRET"
    rep = lambda x: x.repeat_interleave(CASE.group, dim=2)  # noqa: E731
    ref_o, ref_s = torch_recurrent_gated_delta_rule(
        rep(q), rep(k), v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert_rel(o, ref_o, 1e-5, "o")
    assert_rel(states[0], ref_s, 1e-5, "state")


def test_attention_and_lm_head_on_cpu_run_naive_twins_matching_transformers():
    """Without the interpreter: no launch; decode_attention equals transformers' eager attention over
    the live prefix of the buffer (its GQA head mapping, its causal mask), lm_head_top1 the eager
    logits' argmax and softmax."""
    from types import SimpleNamespace

    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import eager_attention_forward

    gen = torch.Generator().manual_seed(2)
    B, W, Hq, Hkv, D, S, L = 1, 5, 8, 2, 16, 40, 11
    q = torch.randn(B, W, Hq, D, generator=gen)
    keys, values = torch.randn(2, B, Hkv, S, D, generator=gen)
    hidden, weight = torch.randn(7, 32, generator=gen), torch.randn(90, 32, generator=gen)
    before = sum(launch_counts.values())
    out = decode_attention(q, keys, values, torch.tensor([L]), scale=0.3)
    tokens, conf, ent = lm_head_top1(hidden, weight)
    assert sum(launch_counts.values()) == before, "no Triton launch expected on CPU without TRITON_INTERPRET"
    causal = torch.zeros(W, L + W).masked_fill(torch.arange(L + W)[None] > L + torch.arange(W)[:, None], float("-inf"))
    module = SimpleNamespace(num_key_value_groups=Hq // Hkv, training=False)
    ref, _ = eager_attention_forward(module, q.transpose(1, 2), keys[:, :, :L + W], values[:, :, :L + W],
                                     causal[None, None], scaling=0.3)
    assert_rel(out, ref, 1e-6, "decode_attention vs eager attention")
    logits = hidden @ weight.T
    probs = logits.softmax(-1)
    assert torch.equal(tokens, logits.argmax(-1))
    assert_rel(conf, probs.max(-1).values, 1e-6, "confidence")
    assert_rel(ent, -(probs * probs.log()).sum(-1), 1e-5, "entropy")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "q": a["q"][:, :, :1]}, r"q and k must be \[B, T, HK, K\] alike"),
        (lambda a: {**a, "q": a["q"].repeat(1, 3, 1, 1), "k": a["k"].repeat(1, 3, 1, 1)}, r"T must be in 1..16"),
        (lambda a: {**a, "v": a["v"][:, :, :3]}, r"value heads \(3\) must be a multiple of key heads \(2\)"),
        (lambda a: {**a, "state": a["state"].double()}, r"state must be contiguous fp32"),
        (lambda a: {**a, "g": a["g"][:, :, :2]}, r"g and beta must be \[B, T, HV\]"),
        (lambda a: {**a, "num_tokens": torch.tensor([1.0, 2.0])}, r"num_tokens must be an integer tensor of shape \[B\]"),
        (lambda a: {**a, "q": a["q"].int()}, r"q must be fp32, bf16 or fp16"),
    ],
)
def test_verify_rejects_bad_input_naming_shapes(change, message):
    q, k, v, g, beta, state = make_inputs(CASE, "cpu")
    args = change(dict(q=q, k=k, v=v, g=g, beta=beta, state=state))
    with pytest.raises(ValueError, match=message):
        gdn_verify(**args)


def test_verify_rejects_head_dim_not_power_of_two():
    case = GDNCase(**{**CASE.__dict__, "K": 16})
    q, k, v, g, beta, state = make_inputs(case, "cpu")
    with pytest.raises(ValueError, match="key head dim must be a power of two in \\[16, 256\\], got 12"):
        gdn_verify(q[..., :12], k[..., :12], v, g, beta, state[:, :, :12])


def test_commit_rejects_mismatched_factors():
    q, k, v, g, beta, state = make_inputs(CASE, "cpu")
    _, f = gdn_verify(q, k, v, g, beta, state)
    with pytest.raises(ValueError, match=r"states must be \[L, B, HV, K, V\]"):
        gdn_commit(state, GDNFactors(*(x[None] for x in f)), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"factors.z must be \[L, B, T, HV, V\] = \[2, 2, T, 4, 32\]"):
        gdn_commit(torch.stack([state, state]), GDNFactors(*(x[None] for x in f)), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"num_commit must be an integer tensor of shape \[B\] = \[2\]"):
        gdn_commit(state[None].clone(), GDNFactors(*(x[None] for x in f)), torch.tensor([1]))
