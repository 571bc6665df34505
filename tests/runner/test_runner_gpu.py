"""The captured runner on CUDA: graph replays give the eager runner's rounds and target-only tokens."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridspec
from hybridspec.sim.replay import DeviceReplayDrafter
from hybridspec.runner import Runner
from hybridspec.tiny import tiny_drafter
from tests.calibration.synthetic import synthetic_calibration
from tests.helpers import count_top1
from tests.models import qwen3_next_causal_lm, qwen35_causal_lm

PROMPT = torch.arange(3, 14)[None]
MAX_NEW = 48


def generate(model, drafter, enforce_eager, seed=0, **kwargs):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(PROMPT.cuda(), max_new_tokens=MAX_NEW, eos_token_id=None, assistant_model=drafter,
                              hybridspec=True, enforce_eager=enforce_eager, return_dict_in_generate=True, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("build", [qwen35_causal_lm, qwen3_next_causal_lm])
@pytest.mark.parametrize("lengths", ["w=16", "uncalibrated", "hybridspec", "evict"])
def test_captured_rounds_equal_eager_rounds_and_target_only(build, lengths):
    model = build(seed=4).cuda()
    ref = model.generate(PROMPT.cuda(), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    hybridspec.enable(model)
    replay = DeviceReplayDrafter(tiny_drafter().cuda(), ref[0, PROMPT.shape[1]:])

    def arguments(drafter):
        if lengths == "w=16":
            return dict(verify_length=16)
        if lengths == "uncalibrated":
            return dict(policy="hybridspec")
        return dict(policy=lengths, calibration=synthetic_calibration(model, drafter))

    # a deterministic drafter: graph replays and eager rounds must agree round for round
    dflash = replay.drafter
    kwargs = arguments(dflash)
    graphs = generate(model, dflash, False, **kwargs)
    assert model._hybridspec_runner.captured
    eager = generate(model, dflash, True, **kwargs)
    assert not model._hybridspec_runner.captured
    assert torch.equal(graphs.sequences, ref) and torch.equal(eager.sequences, ref)
    assert graphs.hybridspec_stats == eager.hybridspec_stats
    # simulated acceptance (draws from the CUDA generator, whose stream differs between a graph
    # and eager launches): exact, seeded, and long accepted runs
    kwargs = arguments(replay)
    runs = [generate(model, replay, False, seed=5, **kwargs) for _ in range(2)]
    assert all(torch.equal(r.sequences, ref) for r in runs)
    assert runs[0].hybridspec_stats == runs[1].hybridspec_stats
    stats = runs[0].hybridspec_stats
    assert max(stats.accepted) > 2
    if lengths == "hybridspec":
        assert any(w == w0 + 1 for w, w0 in zip(stats.verify_lengths, stats.nominal_lengths))
    assert torch.equal(generate(model, replay, True, seed=5, **kwargs).sequences, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("build", [qwen35_causal_lm, qwen3_next_causal_lm])
@pytest.mark.parametrize("gated", [0, 1], ids=["norm-apart", "gated-verify"])
@pytest.mark.parametrize("prologue", [0, 1], ids=["prologue-apart", "prologue-fused"])
def test_captured_autoregressive_runner_equals_target_only(build, gated, prologue, monkeypatch):
    """The captured AR step against target-only decoding, with the GDN mixer's gated norm apart
    and inside the one-row verify kernel (`VERIFY_CONFIG["gated_one_row"]`), and the attention
    mixer's norms, rotary and KV write apart and in `attention_prologue` (`PROLOGUE_CONFIG`)."""
    from hybridspec.ops import gdn as gdn_mod
    from hybridspec.ops import prologue as prologue_mod

    monkeypatch.setitem(gdn_mod.VERIFY_CONFIG, "gated_one_row", gated)
    monkeypatch.setitem(prologue_mod.PROLOGUE_CONFIG, "fused", prologue)
    model = build(seed=4).cuda()
    ref = model.generate(PROMPT.cuda(), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    runner = Runner(model, capacity=256)
    assert runner.captured
    for _ in range(2):
        out, stats = runner.generate(PROMPT.cuda(), MAX_NEW)
        assert torch.equal(out, ref) and len(stats.verify_lengths) == MAX_NEW - 1


@pytest.mark.gpu
def test_a_dropped_runner_does_not_break_the_next_capture():
    """A runner dropped by its caller lives on in a reference cycle until the collector runs; with
    the collector forced to run on nearly every allocation, a collection inside the next runner's
    capture would free the old graph there and invalidate the capture (as happened in
    `bench_runner.py --ar-split-k`). The capture collects first, so the second runner captures and
    decodes what the first did."""
    import gc

    model = qwen35_causal_lm(seed=4).cuda()
    first = Runner(model, capacity=256)
    ref, _ = first.generate(PROMPT.cuda(), MAX_NEW)
    del first
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        second = Runner(model, capacity=256)
    finally:
        gc.set_threshold(*threshold)
    assert second.captured
    out, _ = second.generate(PROMPT.cuda(), MAX_NEW)
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("build", [qwen35_causal_lm, qwen3_next_causal_lm])
def test_captured_fused_head_equals_target_only(build, monkeypatch):
    """`Runner(fused_head=True)` captured and compiled: the greedy argmax from `lm_head_top1`'s
    kernels, AR steps and rounds alike, gives target-only decoding's tokens on fp32 models."""
    from hybridspec.policy import FixedPolicy

    calls = count_top1(monkeypatch)
    model = build(seed=4).cuda()
    ref = model.generate(PROMPT.cuda(), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    inner = tiny_drafter().cuda()
    inner.bind(model)
    drafter = DeviceReplayDrafter(inner, ref[0, PROMPT.shape[1]:], vocab_size=model.config.vocab_size)
    for spec in (None, drafter):
        calls.clear()
        runner = Runner(model, spec, FixedPolicy("fixed", 8) if spec is not None else None, capacity=256,
                        fused_head=True)
        assert runner.captured
        out, _ = runner.generate(PROMPT.cuda(), MAX_NEW)
        assert torch.equal(out, ref)
        # the captured step took its argmax from the fused head (traced at capture)
        assert calls


@pytest.mark.gpu
@pytest.mark.parametrize("build", [qwen35_causal_lm, qwen3_next_causal_lm])
def test_captured_split_out_projections_equal_target_only(build, monkeypatch):
    """`LinearKernelConfig(out_split_k=4, router_split_k=4, in_split_k=4)` (the first two the
    default): the target's mixers and the drafter's layers run their output projections as split-K
    partials (`hybridspec.split_projection`), the target's mixers their fused input projections too,
    and the MoE blocks their router GEMMs (added by `route_topk_partials`), captured and compiled; AR
    steps and rounds give target-only decoding's tokens on fp32 models."""
    from hybridspec.ops import linear as linear_ops
    from hybridspec.ops.dispatch import launch_counts
    from hybridspec.policy import FixedPolicy

    model = build(seed=4).cuda()
    ref = model.generate(PROMPT.cuda(), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    monkeypatch.setattr(linear_ops, "KERNEL_CONFIG", linear_ops.LinearKernelConfig(out_split_k=4, router_split_k=4, in_split_k=4))
    inner = tiny_drafter().cuda()
    inner.bind(model)
    drafter = DeviceReplayDrafter(inner, ref[0, PROMPT.shape[1]:], vocab_size=model.config.vocab_size)
    for spec in (None, drafter):
        before = launch_counts["small_linear_partials"], launch_counts["route_topk_partials"]
        runner = Runner(model, spec, FixedPolicy("fixed", 8) if spec is not None else None, capacity=256)
        assert runner.captured
        out, _ = runner.generate(PROMPT.cuda(), MAX_NEW)
        assert torch.equal(out, ref)
        # the projections and routers went through the partials ops (counted when traced and captured)
        assert launch_counts["small_linear_partials"] > before[0]
        assert launch_counts["route_topk_partials"] > before[1]


@pytest.mark.gpu
@pytest.mark.parametrize("build", [qwen35_causal_lm, qwen3_next_causal_lm])
def test_captured_moe_combine_in_consumer_equals_target_only(build, monkeypatch):
    """`MoEKernelConfig(combine_in_consumer=True)`: inside the compiled layers every MoE block runs
    `moe_experts_partials` and its weighted sum fused into the residual add (no reduce launch in
    the captured step); AR steps and rounds give target-only decoding's tokens on fp32 models."""
    from dataclasses import replace

    from hybridspec.ops import moe as moe_ops
    from hybridspec.ops.dispatch import launch_counts
    from hybridspec.policy import FixedPolicy

    model = build(seed=4).cuda()
    ref = model.generate(PROMPT.cuda(), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    monkeypatch.setattr(moe_ops, "KERNEL_CONFIG", replace(moe_ops.KERNEL_CONFIG, combine_in_consumer=True))
    before = launch_counts["moe_experts_partials"]
    inner = tiny_drafter().cuda()
    inner.bind(model)
    drafter = DeviceReplayDrafter(inner, ref[0, PROMPT.shape[1]:], vocab_size=model.config.vocab_size)
    for spec in (None, drafter):
        runner = Runner(model, spec, FixedPolicy("fixed", 8) if spec is not None else None, capacity=256)
        assert runner.captured
        out, _ = runner.generate(PROMPT.cuda(), MAX_NEW)
        assert torch.equal(out, ref)
        # the compiled blocks took the partials (counted when traced and captured)
        assert launch_counts["moe_experts_partials"] > before


@pytest.mark.gpu
@pytest.mark.parametrize("build", [qwen35_causal_lm, qwen3_next_causal_lm])
def test_captured_compiled_front_gives_the_eager_fronts_rounds(build):
    """`Runner(compile_front=True)` captured with compiled layers: the length choice, Stage 0 and the
    routing correction compiled as one region give the same rounds, lengths and tokens as the
    runner that runs them eagerly, under the calibrated policy with its correction, on fp32 models."""
    from hybridspec.policy import from_calibration
    from hybridspec.round.round import front

    model = build(seed=4).cuda()
    ref = model.generate(PROMPT.cuda(), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    hybridspec.enable(model)
    replay = DeviceReplayDrafter(tiny_drafter().cuda(), ref[0, PROMPT.shape[1]:])
    replay.bind(model)
    policy = from_calibration("hybridspec", synthetic_calibration(model, replay), 256)
    runs = []
    for compiled in (False, True):
        runner = Runner(model, replay, policy, capacity=256, compile_front=compiled)
        assert runner.captured and (runner.round.front is front) != compiled
        torch.manual_seed(3)
        runs.append(runner.generate(PROMPT.cuda(), MAX_NEW))
    (eager, eager_stats), (fast, fast_stats) = runs
    assert torch.equal(eager, ref) and torch.equal(fast, ref)
    assert fast_stats == eager_stats and fast_stats.layer0_experts == eager_stats.layer0_experts
    assert len(set(eager_stats.verify_lengths)) > 1
    # the routing correction fired: the compiled region decided on extra tokens as the eager one did
    assert any(w > w0 for w, w0 in zip(eager_stats.verify_lengths, eager_stats.nominal_lengths))


@pytest.mark.gpu
def test_captured_forced_rounds_take_the_fused_head():
    """The benchmark's forced rule (a `Top1AcceptRule`) on the captured, compiled runner: rounds
    take the fused head's top-1 and give the same rounds and tokens as with the logits."""
    from hybridspec.policy import FixedPolicy
    from hybridspec.round.round import Sampler
    from hybridspec.sim.forced import ForcedAcceptance

    model = qwen35_causal_lm(seed=4).cuda()
    ref = model.generate(PROMPT.cuda(), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    hybridspec.enable(model)
    replay = DeviceReplayDrafter(tiny_drafter().cuda(), (ref[0, PROMPT.shape[1]:] + 1) % model.config.vocab_size)
    replay.bind(model)
    rule = ForcedAcceptance(replay)
    runs = []
    for fused in (True, False):
        runner = Runner(model, replay, FixedPolicy("fixed", 16), capacity=256, sampler=Sampler(False, rule=rule),
                        fused_head=fused)
        assert runner.captured and runner.round.fused_head == fused
        torch.manual_seed(5)
        runs.append(runner.generate(PROMPT.cuda(), MAX_NEW))
    (fast, fast_stats), (slow, slow_stats) = runs
    assert torch.equal(fast, slow) and fast_stats == slow_stats and max(fast_stats.accepted) > 2


@pytest.mark.gpu
def test_captured_sampling_is_seeded_and_top_k_one_is_greedy():
    model = hybridspec.enable(qwen35_causal_lm(seed=4).cuda())
    hybridspec.disable(model)
    greedy = model.generate(PROMPT.cuda(), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    hybridspec.enable(model)
    drafter = DeviceReplayDrafter(tiny_drafter().cuda(), greedy[0, PROMPT.shape[1]:])
    runs = [generate(model, drafter, False, seed, do_sample=True, temperature=0.8, verify_length=8).sequences
            for seed in (0, 0, 1)]
    assert model._hybridspec_runner.captured
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    one = generate(model, drafter, False, 0, do_sample=True, top_k=1, verify_length=8).sequences
    assert torch.equal(one, greedy)


@pytest.mark.gpu
def test_cond_dispatch_equals_the_captured_round():
    """Per-length `torch.cond` branches against the captured fixed-shape round (compiled layers)
    of the same policy: the same rounds and target-only tokens."""
    from hybridspec.policy import from_calibration

    model = qwen35_causal_lm(seed=4).cuda()
    ref = model.generate(PROMPT.cuda(), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    hybridspec.enable(model)
    dflash = tiny_drafter().cuda()
    dflash.bind(model)
    policy = from_calibration("hybridspec", synthetic_calibration(model, dflash), 16)
    fixed = Runner(model, dflash, policy, capacity=128)
    assert fixed.captured
    out_fixed, stats_fixed = fixed.generate(PROMPT.cuda(), MAX_NEW)
    del fixed
    cond = Runner(model, dflash, policy, capacity=128, dispatch="cond")
    assert not cond.captured
    out_cond, stats_cond = cond.generate(PROMPT.cuda(), MAX_NEW)
    assert torch.equal(out_fixed, ref) and torch.equal(out_cond, ref)
    assert stats_cond == stats_fixed
    assert len(set(stats_cond.verify_lengths)) >= 2
