"""`hybridspec.enable` and the `generate` arguments: errors, processors, streamers, pipelines, stats."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, TextStreamer

import hybridspec
from hybridspec.sim.scripted import ScriptedReplayDrafter
from tests.models import VOCAB, qwen35_causal_lm


@pytest.fixture(scope="module")
def model():
    m = hybridspec.enable(qwen35_causal_lm(5))
    yield m
    hybridspec.disable(m)


def greedy(model, prompt, **kwargs):
    hybridspec.disable(model)
    out = model.generate(prompt, do_sample=False, **kwargs)
    hybridspec.enable(model)
    return out


def drafter_for(prompt, continuation, schedule=(3, 9, 0, 15)):
    return ScriptedReplayDrafter(prompt.shape[1], continuation[0, prompt.shape[1]:], schedule)


def test_enable_is_idempotent_and_disable_restores(model):
    original = type(model).generate
    hybridspec.enable(model)
    hybridspec.enable(model)
    assert hybridspec.disable(model) is model
    assert model.generate.__func__ is original
    hybridspec.enable(model)


def test_unsupported_model_names_supported_types():
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=16))
    with pytest.raises(TypeError, match="Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM; got LlamaForCausalLM"):
        hybridspec.enable(tiny)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_beams=2), "num_beams=2"),
        (dict(output_attentions=True), "output_attentions=True"),
        (dict(policy="nope"), "policy must be one of"),
        (dict(policy="static"), "needs profiled costs: run `hybridspec calibrate`"),
        (dict(policy="evict"), "needs profiled costs"),
        (dict(verify_length=4, policy="nominal"), "cannot be combined"),
        (dict(verify_length=17), r"verify_length must be in 2..16"),
        (dict(verify_length=1), r"verify_length must be in 2..16"),
        (dict(guidance_scale=2.0), "guidance_scale"),
    ],
)
def test_bad_requests_raise(model, kwargs, message):
    prompt = torch.arange(4)[None]
    with pytest.raises(ValueError, match=message):
        model.generate(prompt, max_new_tokens=4, assistant_model=drafter_for(prompt, prompt), hybridspec=True, **kwargs)


def test_batch_and_padding_raise(model):
    # batches of 1..4 decode (tests/generation/test_batched.py); larger ones and right padding raise
    with pytest.raises(ValueError, match=r"batches of 1 to 4 sequences; got input_ids \(5, 4\)"):
        model.generate(torch.zeros(5, 4, dtype=torch.long), max_new_tokens=2, hybridspec=True,
                       assistant_model=drafter_for(torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.long)))
    with pytest.raises(ValueError, match="right .*padding is not supported"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 0]]),
                       max_new_tokens=2, hybridspec=True,
                       assistant_model=drafter_for(torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.long)))


def test_missing_drafter_and_stray_arguments(model):
    prompt = torch.arange(4)[None]
    with pytest.raises(ValueError, match="needs a drafter"):
        model.generate(prompt, max_new_tokens=2, hybridspec=True)
    with pytest.raises(ValueError, match="verify_length only apply with hybridspec=True"):
        model.generate(prompt, max_new_tokens=2, verify_length=4)


def test_stock_generate_untouched_without_flag(model):
    prompt = torch.arange(6)[None]
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), greedy(model, prompt, max_new_tokens=8))


@pytest.mark.parametrize(
    "processors",
    [
        dict(repetition_penalty=1.5),
        dict(no_repeat_ngram_size=2),
        dict(min_new_tokens=12, eos_token_id=7),
        dict(bad_words_ids=[[3], [5, 6]]),
        dict(sequence_bias={(9,): 4.0}),
    ],
)
def test_logits_processors_apply_per_verified_position(model, processors):
    prompt = torch.tensor([[1, 2, 3, 4, 5, 1, 2]])
    ref = greedy(model, prompt, max_new_tokens=30, **processors)
    got = model.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter_for(prompt, ref),
                         hybridspec=True, **processors)
    assert torch.equal(got, ref)


def test_generation_config_eos_list_and_stats(model):
    prompt = torch.arange(10, 19)[None]
    free = greedy(model, prompt, max_new_tokens=40, eos_token_id=None)
    eos = [int(free[0, 20]), VOCAB - 1]
    config = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=eos)
    ref = greedy(model, prompt, generation_config=config)
    out = model.generate(prompt, generation_config=config, assistant_model=drafter_for(prompt, free), hybridspec=True,
                         return_dict_in_generate=True, output_scores=True)
    assert torch.equal(out.sequences, ref)
    stats = out.hybridspec_stats
    assert sum(a + 1 for a in stats.accepted) >= out.sequences.shape[1] - prompt.shape[1] - 1
    assert stats.mean_acceptance_length == pytest.approx(sum(a + 1 for a in stats.accepted) / len(stats.accepted))
    assert len(out.scores) == out.sequences.shape[1] - prompt.shape[1]


def test_text_streamer_gets_every_token(model):
    class Recorder(TextStreamer):
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, value):
            self.tokens.extend(value.flatten().tolist())

        def end(self):
            self.ended = True

    prompt = torch.arange(5)[None]
    ref = greedy(model, prompt, max_new_tokens=25)
    rec = Recorder()
    got = model.generate(prompt, max_new_tokens=25, do_sample=False, streamer=rec,
                         assistant_model=drafter_for(prompt, ref), hybridspec=True)
    assert torch.equal(got, ref)
    assert rec.tokens == got[0].tolist() and rec.ended
