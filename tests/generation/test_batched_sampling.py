"""Sampling in a left-padded batch of two (issue 18): each row's first tokens follow target-only
sampling of its own prompt (chi-square against the enumerated law, as tests/generation/test_sampling.py
checks batch one)."""

from __future__ import annotations

import pytest
import torch

import hybridspec
from hybridspec.sim.replay import DeviceReplayDrafter
from tests.generation.test_sampling import ALPHA, chi_square_pvalue, small_target
from tests.models import VOCAB, config, random_drafter

PROMPTS = ([11, 4, 97, 30], [57, 8])
FIRST = 3
SETTING = dict(temperature=0.7, top_k=3)
SAMPLES = 200


def row_law(model, prompt: list[int]) -> dict:
    """The target-only law of the first FIRST tokens after `prompt`, by enumerating the support."""
    law = {(): 1.0}
    for _ in range(FIRST):
        contexts = list(law)
        ids = torch.tensor([prompt + list(c) for c in contexts])
        out = model.generate(ids, do_sample=True, max_new_tokens=1, return_dict_in_generate=True, output_scores=True,
                             **SETTING)
        probs = out.scores[0].double().softmax(-1)
        law = {c + (x,): law[c] * p[x].item() for c, p in zip(contexts, probs) for x in p.nonzero().flatten().tolist()}
    return law


@pytest.fixture(scope="module")
def model():
    m = small_target()
    yield m
    hybridspec.disable(m)


@pytest.mark.parametrize("lengths", [dict(policy="hybridspec"), dict(verify_length=3)])
def test_rows_follow_target_only_sampling(model, lengths):
    laws = [row_law(model, p) for p in PROMPTS]
    hybridspec.enable(model)
    P = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in PROMPTS])
    mask = (ids != 0).long()
    mask[:, -1] = 1
    greedy = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=FIRST + 1, pad_token_id=0,
                            assistant_model=DeviceReplayDrafter(drafter(), torch.zeros(2, 1, dtype=torch.long)),
                            hybridspec=True, verify_length=2)
    # drafts from the greedy path: accepted often under this peaked, top-3 target
    replay = DeviceReplayDrafter(drafter(), greedy[:, P:])
    torch.manual_seed(0)
    drawn = [[], []]
    kept = 0
    for _ in range(SAMPLES):
        out = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=FIRST + 1, pad_token_id=0,
                             eos_token_id=None, assistant_model=replay, hybridspec=True, enforce_eager=True,
                             return_dict_in_generate=True, **SETTING, **lengths)
        for b in range(2):
            drawn[b].append(tuple(out.sequences[b, P: P + FIRST].tolist()))
        kept += sum(a > 0 for a in out.hybridspec_stats.accepted)
    assert kept > SAMPLES // 2, "the drafts are rarely kept: the test would not exercise acceptance"
    for b, law in enumerate(laws):
        assert set(drawn[b]) <= set(law), f"row {b}: a sequence of probability 0 under target-only sampling"
        keys = list(law)
        counts = torch.tensor([drawn[b].count(k) for k in keys])
        p = chi_square_pvalue(counts, SAMPLES * torch.tensor([law[k] for k in keys]))
        print(f"{lengths}, row {b}: chi-square p = {p:.3f}")
        assert p > ALPHA, f"row {b}: chi-square p = {p:.2e}"


_DRAFTER = []


def drafter():
    """A drafter for the two-layer target (taps 0 and 1), made once."""
    if not _DRAFTER:
        raw = config(num_target_layers=2, dflash_config={"target_layer_ids": [0, 1], "mask_token_id": VOCAB - 3})
        _DRAFTER.append(random_drafter(raw))
    return _DRAFTER[0]
