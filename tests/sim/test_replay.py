"""The replay drafter: its fixed acceptance model alone, then end to end around a real DFlash drafter."""

from __future__ import annotations

import math

import pytest
import torch

import hybridspec
from hybridspec.sim.replay import ReplayDrafter, replay_round
from tests.models import VOCAB, config, qwen35_causal_lm, random_drafter

D = 15
ROUNDS = 20_000


def simulate(seed: int, rounds: int = ROUNDS):
    truth = torch.randint(0, VOCAB, (rounds, D), generator=torch.Generator().manual_seed(123))
    # one batch row per round: rows draw independently, as successive rounds do
    drawn = replay_round(torch.Generator().manual_seed(seed), truth, torch.ones_like(truth, dtype=torch.bool), VOCAB)
    return truth, drawn


def test_acceptance_model_mean_length_and_informative_confidence():
    truth, drawn = simulate(seed=0)
    # A = leading correct drafts; all D = 15 are verified at w = 16
    emitted = 1 + drawn.correct.long().cumprod(-1).sum(-1)
    mean = emitted.float().mean().item()
    print(f"simulated mean acceptance length (A + 1) over {ROUNDS} rounds: {mean:.3f} (analytic 4.571)")
    assert 4.3 <= mean <= 4.9
    conf = drawn.confidence
    assert conf[drawn.correct].mean() > conf[~drawn.correct].mean() + 0.1
    assert torch.equal(drawn.tokens == truth, drawn.correct)  # a wrong token never equals the truth
    assert ((drawn.tokens >= 0) & (drawn.tokens < VOCAB)).all()
    # entropy of (p, (1 - p) / 63 x 63): between 0 and log 64
    assert (drawn.entropy >= 0).all() and (drawn.entropy <= math.log(64) + 1e-5).all()
    p = conf[0, 0]
    assert drawn.entropy[0, 0] == pytest.approx((-p * p.log() - (1 - p) * ((1 - p) / 63).log()).item(), rel=1e-5)


def test_seeds_fix_the_draws_and_unknown_positions_are_wrong():
    a, b, c = simulate(1, 64)[1], simulate(1, 64)[1], simulate(2, 64)[1]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a.correct, c.correct)
    truth = torch.zeros(8, D, dtype=torch.long)
    known = torch.arange(D)[None].expand(8, -1) < 5
    drawn = replay_round(torch.Generator().manual_seed(0), truth, known, VOCAB)
    assert not drawn.correct[:, 5:].any() and (drawn.tokens[:, 5:] != 0).all()


def test_generate_with_replay_over_dflash_equals_greedy():
    model = qwen35_causal_lm(3)
    prompt = torch.tensor([[11, 4, 97, 30, 8, 52, 17]])
    ref = model.generate(prompt, do_sample=False, max_new_tokens=60)
    real = random_drafter(config(), seed=1)
    calls = []
    propose = real.propose
    real.propose = lambda seq: calls.append(seq.shape[1]) or propose(seq)  # the real forward runs every round
    drafter = ReplayDrafter(real, ref[0, prompt.shape[1]:], seed=7)
    hybridspec.enable(model)
    try:
        out = model.generate(prompt, do_sample=False, max_new_tokens=60, assistant_model=drafter, hybridspec=True,
                             return_dict_in_generate=True)
    finally:
        hybridspec.disable(model)
    assert torch.equal(out.sequences, ref)
    stats = out.hybridspec_stats
    print(f"end-to-end simulated mean acceptance length: {stats.mean_acceptance_length:.2f} over {stats.rounds} rounds")
    assert len(calls) == stats.rounds
    assert stats.mean_acceptance_length >= 2.5
