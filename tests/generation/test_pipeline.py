"""`pipeline("text-generation")` with hybridspec: the generate arguments go in the call's keywords.

The text-generation pipeline (transformers 5.17 and 5.24) passes every unknown call keyword to
`model.generate`, which is how `assistant_model=` and `hybridspec=True` reach it. Its nested
`generate_kwargs={...}` form is handed to `generate` verbatim and fails in stock transformers too
("model_kwargs are not used: ['generate_kwargs']"), and `pipeline(..., assistant_model=drafter)`
expects a transformers model; neither is a route for a drafter.
"""

from __future__ import annotations

import pytest
import torch
from transformers import pipeline

import hybridspec
from hybridspec.sim.scripted import ScriptedReplayDrafter
from tests.models import qwen35_causal_lm, tiny_tokenizer

TEXT = "w5 w9 w30 w7 w100 w64"
NEW = 40


@pytest.fixture(scope="module")
def setup():
    model = hybridspec.enable(qwen35_causal_lm(4))
    tok = tiny_tokenizer()
    yield model, tok, pipeline("text-generation", model=model, tokenizer=tok)
    hybridspec.disable(model)


def test_pipeline_adds_and_strips_nothing(setup):
    model, tok, pipe = setup
    prompt = tok(TEXT, return_tensors="pt").input_ids
    assert prompt.tolist() == [[5, 9, 30, 7, 100, 64]]  # no BOS, one id per word
    ids = pipe(TEXT, max_new_tokens=NEW, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    assert ids == model.generate(prompt, max_new_tokens=NEW, do_sample=False)[0].tolist()
    # the pipeline decodes the new tokens alone and appends them to the prompt text
    text = pipe(TEXT, max_new_tokens=NEW, do_sample=False)[0]["generated_text"]
    assert text == TEXT + tok.decode(ids[prompt.shape[1]:]) and text.startswith(TEXT + " w")


@pytest.mark.parametrize("eos_at", [None, 17])
def test_pipeline_text_equals_target_only(setup, eos_at):
    model, tok, pipe = setup
    P = len(tok(TEXT).input_ids)
    kwargs = dict(max_new_tokens=NEW, do_sample=False)
    free = pipe(TEXT, return_tensors=True, **kwargs)[0]["generated_token_ids"]
    if eos_at is not None:
        # stop inside an accepted block: an EOS list with the tokenizer's EOS and a generated token
        kwargs["eos_token_id"] = [tok.eos_token_id, free[P + eos_at]]
    ref = pipe(TEXT, **kwargs)
    drafter = ScriptedReplayDrafter(P, torch.tensor(free[P:]), (3, 9, 0, 15))
    got = pipe(TEXT, assistant_model=drafter, hybridspec=True, **kwargs)
    assert got == ref
    # acceptance happened: fewer rounds than new tokens
    assert 0 < drafter.rounds < NEW // 2
    if eos_at is not None:  # stopped at the first occurrence of that token, which it keeps
        stop = free[P:].index(free[P + eos_at])
        assert tok(got[0]["generated_text"]).input_ids == free[: P + stop + 1]
