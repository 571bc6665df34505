"""Speculative greedy decoding equals the unpatched model's `generate(do_sample=False)`."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import hybridspec
from hybridspec.sim.scripted import ScriptedReplayDrafter
from hybridspec.state import HybridState
from tests.helpers import rel_err
from hybridspec import DFlashDrafter
from tests.models import VOCAB, config, qwen3_next_causal_lm, qwen35_causal_lm, qwen35_checkpoint_layout, random_drafter

MAX_NEW = 40
MARGIN = 1e-5
# mismatches allowed per test, each only at a near-tie of the reference (printed so they are seen)
MAX_NEAR_TIES = 3


BUILDERS = {"qwen35_causal_lm": qwen35_causal_lm, "qwen35_checkpoint_layout": qwen35_checkpoint_layout,
            "qwen3_next": qwen3_next_causal_lm}


@pytest.fixture(scope="module", params=list(BUILDERS))
def model(request):
    m = BUILDERS[request.param](seed=len(request.param))
    yield m
    hybridspec.disable(m)


def reference(model, prompt, max_new_tokens, eos):
    hybridspec.disable(model)
    out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                         return_dict_in_generate=True, output_logits=True)
    hybridspec.enable(model)
    return out


def assert_same_or_near_tie(ref, got, case, near_ties: list):
    a, b = ref.sequences[0], got[0]
    if torch.equal(a, b):
        return
    n = min(len(a), len(b))
    first = next(i for i in range(n + 1) if i == n or a[i] != b[i])
    step = first - (len(a) - len(ref.logits))
    top2 = ref.logits[step][0].topk(2).values
    margin = (top2[0] - top2[1]).item()
    assert margin < MARGIN, f"{case}: first difference at token {first}, reference margin {margin:.2e}"
    near_ties.append(f"{case}: margin {margin:.2e}")


def check_near_ties(near_ties: list) -> None:
    print(f"near-tie mismatches: {len(near_ties)}", *near_ties, sep="\n  ")
    assert len(near_ties) <= MAX_NEAR_TIES, near_ties


# 3 families x 40 = 120 cases
def test_tokens_equal_target_only_greedy(model):
    near_ties = []
    check_greedy_cases(model, near_ties)
    check_near_ties(near_ties)


@settings(max_examples=40)
@given(
    prompt_len=st.integers(1, 20),
    max_new=st.integers(1, MAX_NEW),
    verify_length=st.sampled_from([None, 2, 3, 5, 8, 13, 16]),
    schedule=st.lists(st.integers(0, 15), min_size=1, max_size=6),
    eos_at=st.one_of(st.none(), st.integers(0, MAX_NEW - 1)),
    seed=st.integers(0, 2**16),
)
def check_greedy_cases(model, near_ties, prompt_len, max_new, verify_length, schedule, eos_at, seed):
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    free = reference(model, prompt, MAX_NEW, None).sequences[0, prompt_len:]
    # an EOS taken from the continuation itself, so it lands inside an accepted block
    eos = None if eos_at is None else int(free[eos_at])
    ref = reference(model, prompt, max_new, eos)
    drafter = ScriptedReplayDrafter(prompt_len, free, schedule, block_size=16)
    got = model.generate(prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                         assistant_model=drafter, hybridspec=True, verify_length=verify_length)
    assert_same_or_near_tie(ref, got, f"prompt {prompt_len}, max_new {max_new}, w {verify_length}, {schedule}",
                            near_ties)


def test_every_acceptance_length_is_reached(model):
    prompt = torch.arange(5)[None]
    free = reference(model, prompt, 200, None).sequences[0, 5:]
    drafter = ScriptedReplayDrafter(5, free, list(range(16)), block_size=16)
    out = model.generate(prompt, max_new_tokens=200, do_sample=False, eos_token_id=None, assistant_model=drafter,
                         hybridspec=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences[0, 5:], free)
    assert set(out.hybridspec_stats.accepted) >= set(range(16))


def test_state_after_every_round_equals_target_only(model, monkeypatch):
    checked = []
    commit = HybridState.commit

    def checking_commit(self, m):
        commit(self, m)
        length = int(self.length)
        checked.append(length)
        committed = seq_holder[0][:, :length]
        cache = DynamicCache(config=model.config)
        model(committed, use_cache=True, **{cache_kwarg: cache})
        for n, layer in enumerate(self.gdn_layers):
            assert rel_err(self.gdn_states[n], cache.layers[layer].recurrent_states[0]) <= 1e-5
            assert rel_err(self.conv_windows[n], cache.layers[layer].conv_states[0]) <= 1e-6
        for n, layer in enumerate(self.attn_layers):
            assert rel_err(self.keys[n][:, :, :length], cache.layers[layer].keys) <= 1e-5
            assert rel_err(self.values[n][:, :, :length], cache.layers[layer].values) <= 1e-5

    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    prompt = torch.arange(3, 12)[None]
    free = reference(model, prompt, 30, None).sequences
    seq_holder = [free]
    monkeypatch.setattr(HybridState, "commit", checking_commit)
    drafter = ScriptedReplayDrafter(9, free[0, 9:], [0, 4, 15, 2], block_size=16)
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, assistant_model=drafter,
                         hybridspec=True)
    assert torch.equal(out, free)
    assert len(checked) >= 3


def test_dflash_drafter_saved_and_reloaded(model, tmp_path_factory):
    near_ties = []
    check_saved_drafters(model, tmp_path_factory, near_ties)
    check_near_ties(near_ties)


@settings(max_examples=6)
@given(prompt_len=st.integers(1, 16), max_new=st.integers(1, MAX_NEW), block=st.sampled_from([4, 8, 16]),
       verify_length=st.sampled_from([None, 2, 4]), seed=st.integers(0, 2**16))
def check_saved_drafters(model, tmp_path_factory, near_ties, prompt_len, max_new, block, verify_length, seed):
    # taps out of order: features must follow the drafter's own order
    raw = config(block_size=block, dflash_config={"target_layer_ids": [3, 0], "mask_token_id": VOCAB - 3})
    path = tmp_path_factory.mktemp("drafter")
    random_drafter(raw, seed).save_pretrained(path)
    drafter = DFlashDrafter.from_pretrained(path, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    ref = reference(model, prompt, max_new, None)
    w = None if verify_length is None else min(verify_length, block)
    got = model.generate(prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                         assistant_model=drafter, hybridspec=True, verify_length=w)
    assert_same_or_near_tie(ref, got, f"dflash block {block}, prompt {prompt_len}, max_new {max_new}", near_ties)
