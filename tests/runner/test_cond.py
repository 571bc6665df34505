"""Per-length `torch.cond` dispatch (`hybridspec/runner/cond.py`) against the fixed-shape round
and target-only decoding, on the CPU. Tracing the 16 branches takes about a minute per runner."""

from __future__ import annotations

import pytest
import torch

import hybridspec
from hybridspec.sim.replay import DeviceReplayDrafter
from hybridspec.policy import FixedPolicy, from_calibration
from hybridspec.runner import Runner
from tests.calibration.synthetic import synthetic_calibration
from tests.models import VOCAB, qwen3_next_causal_lm, qwen35_causal_lm, random_drafter

MAX_NEW = 40


# the two-stage round (Stage 1 in the branches) and the whole-stack verification
@pytest.mark.parametrize("build,policy", [(qwen35_causal_lm, "hybridspec"), (qwen3_next_causal_lm, "no_two_stage")])
def test_cond_dispatch_equals_the_fixed_round_and_target_only(build, policy):
    model, drafter = build(seed=11), random_drafter(seed=2)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    ref = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)
    hybridspec.enable(model)
    replay = DeviceReplayDrafter(drafter, ref[0, prompt.shape[1]:])
    replay.bind(model)
    chosen = from_calibration(policy, synthetic_calibration(model, replay), 16)
    runs = {}
    for dispatch in ("fixed", "cond"):
        runner = Runner(model, replay, chosen, capacity=64, dispatch=dispatch)
        torch.manual_seed(0)
        runs[dispatch] = runner.generate(prompt, MAX_NEW)
    hybridspec.disable(model)
    (fixed, fixed_stats), (cond, cond_stats) = runs["fixed"], runs["cond"]
    assert torch.equal(fixed, ref) and torch.equal(cond, ref)
    # the same lengths, corrections and acceptance, round for round
    assert cond_stats == fixed_stats
    # several branches ran
    assert len(set(cond_stats.verify_lengths)) >= 3, cond_stats.verify_lengths


def test_cond_dispatch_arguments_are_checked():
    model = qwen35_causal_lm(seed=11)
    hybridspec.enable(model)
    with pytest.raises(ValueError, match="autoregressive"):
        Runner(model, capacity=64, dispatch="cond")
    replay = DeviceReplayDrafter(random_drafter(seed=2), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="'fixed' or 'cond'"):
        Runner(model, replay, FixedPolicy("fixed", 4), capacity=64, dispatch="switch")
    with pytest.raises(ValueError, match="inductor"):
        Runner(model, replay, FixedPolicy("fixed", 4), capacity=64, dispatch="cond", compile=True)
    hybridspec.disable(model)
