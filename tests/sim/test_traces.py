"""Acceptance traces: recorded from a pair, saved and loaded, replayed in recorded order."""

from __future__ import annotations

import pytest
import torch

import hybridspec
from hybridspec.sim.forced import ForcedAcceptance
from hybridspec.sim.replay import DeviceReplayDrafter
from hybridspec.sim.traces import Trace, TraceAcceptance, record_trace
from hybridspec.tiny import tiny_drafter, tiny_target


def made_up(accepted, D=15):
    R = len(accepted)
    g = torch.Generator().manual_seed(1)
    return Trace(torch.rand(R, D, generator=g), torch.rand(R, D, generator=g), torch.tensor(accepted), "made up")


def test_recorded_rounds_are_full_verifications():
    model, drafter = hybridspec.enable(tiny_target()), tiny_drafter()
    prompts = [torch.arange(1, 9)[None], torch.arange(20, 31)[None]]
    trace = record_trace(model, drafter, prompts, max_new_tokens=40, source="tiny")
    R, D = trace.confidence.shape
    assert D == drafter.block_size - 1 and R >= 2
    assert bool(((trace.confidence > 0) & (trace.confidence <= 1)).all()) and bool((trace.entropy >= 0).all())
    hybridspec.disable(model)


def test_save_load_round_trip_and_bad_input(tmp_path):
    trace = made_up([3, 0, 15])
    trace.save(tmp_path / "t.json")
    back = Trace.load(tmp_path / "t.json")
    assert torch.equal(back.accepted, trace.accepted) and torch.allclose(back.confidence, trace.confidence)
    assert back.digest == trace.digest
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="is not an acceptance trace"):
        Trace.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="accepted drafts must be in 0..15"):
        made_up([16])


@pytest.mark.parametrize("reference_loop", [False, True], ids=["runner", "reference_loop"])
def test_forced_rounds_follow_the_trace_in_order(reference_loop):
    model, real = hybridspec.enable(tiny_target()), tiny_drafter()
    prompt = torch.arange(1, 9)[None]
    hybridspec.disable(model)
    continuation = model.generate(prompt, max_new_tokens=60, do_sample=False)[0, prompt.shape[1]:]
    hybridspec.enable(model)
    accepted = [3, 0, 7, 1, 15, 2]
    replay = DeviceReplayDrafter(real, continuation, acceptance=TraceAcceptance(made_up(accepted)))
    out = model.generate(prompt, assistant_model=replay, hybridspec=True, verify_length=16, max_new_tokens=30,
                         do_sample=False, return_dict_in_generate=True, reference_loop=reference_loop,
                         hybridspec_accept=ForcedAcceptance(replay))
    got = out.hybridspec_stats.accepted
    # the last round may be cut by the output limit
    assert got[:-1] == (accepted * 4)[: len(got) - 1] and got[-1] <= (accepted * 4)[len(got) - 1]
    assert torch.equal(out.sequences[0, prompt.shape[1]:], continuation[:30])
    hybridspec.disable(model)


def test_trace_changes_the_replay_fingerprint():
    real = tiny_drafter()
    synthetic = DeviceReplayDrafter(real, torch.zeros(1, dtype=torch.long))
    traced = DeviceReplayDrafter(real, torch.zeros(1, dtype=torch.long), acceptance=TraceAcceptance(made_up([1])))
    assert synthetic.fingerprint_config() != traced.fingerprint_config()
