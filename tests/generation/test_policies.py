"""Every length policy keeps greedy outputs identical to target-only decoding; two-stage and
single-stage verification of the same lengths agree round for round."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import hybridspec
from hybridspec.generation.options import POLICIES
from hybridspec.sim.replay import ReplayDrafter
from tests.calibration.synthetic import W, synthetic_calibration
from tests.models import VOCAB, config, qwen35_causal_lm, random_drafter

MAX_NEW = 40


@pytest.fixture(scope="module")
def pair():
    model = hybridspec.enable(qwen35_causal_lm(11))
    drafter = random_drafter(seed=2)
    yield model, drafter
    hybridspec.disable(model)


def prompt_and_reference(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (1, 3 + seed % 9), generator=g)
    hybridspec.disable(model)
    ref = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)
    hybridspec.enable(model)
    return prompt, ref


def run(model, drafter, prompt, ref, seed, **kwargs):
    replay = ReplayDrafter(drafter, ref[0, prompt.shape[1]:], seed=seed)
    return model.generate(prompt, assistant_model=replay, hybridspec=True, max_new_tokens=MAX_NEW, do_sample=False,
                          return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_target_only(pair, policy):
    model, drafter = pair
    calibration = synthetic_calibration(model, ReplayDrafter(drafter, torch.zeros(0)))
    for seed in range(3):
        prompt, ref = prompt_and_reference(model, seed)
        out = run(model, drafter, prompt, ref, seed, policy=policy, calibration=calibration)
        assert torch.equal(out.sequences, ref), f"policy {policy}, prompt seed {seed}"
        lengths = out.hybridspec_stats.verify_lengths
        # shorter lengths only where the output budget left fewer tokens
        if policy == "static":
            assert all(w == 6 or w < 6 for w in lengths) and lengths[0] == 6
        if policy == "dcut":
            assert all(w in (4, 8, 12, 16) or w < 4 for w in lengths)


def test_two_stage_equals_single_stage(pair):
    """The same lengths from Stage 0 + Stage 1 and from a fresh forward: identical tokens,
    acceptance and round counts; and the correction both adds a token and declines to."""
    model, drafter = pair
    calibration = synthetic_calibration(model, ReplayDrafter(drafter, torch.zeros(0)))
    added = declined = 0
    for seed in range(8):
        prompt, ref = prompt_and_reference(model, 100 + seed)
        split = run(model, drafter, prompt, ref, seed, policy="hybridspec", calibration=calibration)
        single = run(model, drafter, prompt, ref, seed, policy="no_two_stage", calibration=calibration)
        assert torch.equal(split.sequences, ref) and torch.equal(single.sequences, ref)
        a, b = split.hybridspec_stats, single.hybridspec_stats
        assert (a.verify_lengths, a.nominal_lengths, a.accepted) == (b.verify_lengths, b.nominal_lengths, b.accepted)
        for w, w0 in zip(a.verify_lengths, a.nominal_lengths):
            assert w in (w0, w0 + 1)
            added += w == w0 + 1
            declined += w == w0 < W
    assert added > 0 and declined > 0, (added, declined)


def test_correction_off_without_calibration_and_for_nominal(pair):
    model, drafter = pair
    prompt, ref = prompt_and_reference(model, 5)
    calibration = synthetic_calibration(model, ReplayDrafter(drafter, torch.zeros(0)))
    for kwargs in (dict(policy="nominal", calibration=calibration), dict(policy="hybridspec")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stats = run(model, drafter, prompt, ref, 0, **kwargs).hybridspec_stats
        assert stats.verify_lengths == stats.nominal_lengths


def test_mismatched_calibration(pair, tmp_path):
    model, drafter = pair
    prompt, ref = prompt_and_reference(model, 1)
    replay = ReplayDrafter(drafter, torch.zeros(0))
    other = random_drafter(config(num_hidden_layers=1), seed=2)
    path = tmp_path / "calib.json"
    synthetic_calibration(model, ReplayDrafter(other, torch.zeros(0))).save(path)
    with pytest.raises(ValueError, match="drafter"):
        run(model, drafter, prompt, ref, 0, calibration=str(path))
    with pytest.raises(ValueError, match="target"):
        run(model, drafter, prompt, ref, 0, calibration=synthetic_calibration(qwen35_causal_lm(0).eval(), replay,
                                                                             target_fingerprint="0" * 64))
    moved = dataclasses.replace(synthetic_calibration(model, replay), device_name="NVIDIA H200")
    with pytest.warns(UserWarning, match="H200"):
        out = run(model, drafter, prompt, ref, 0, calibration=moved)
    assert torch.equal(out.sequences, ref)
