"""The runner (fixed-shape rounds, device-resident lengths) against target-only decoding and the
reference loop, on the CPU (the same step functions the GPU captures; GPU tests replay graphs)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import TextStreamer

import hybridspec
from hybridspec.generation.options import POLICIES
from hybridspec.sim.forced import ForcedAcceptance
from hybridspec.sim.replay import DeviceReplayDrafter
from hybridspec.runner import Runner
from tests.calibration.synthetic import synthetic_calibration
from tests.helpers import count_top1
from tests.models import VOCAB, qwen3_next_causal_lm, qwen35_causal_lm, random_drafter

MAX_NEW = 32
BUILDERS = {"qwen3.5-moe": qwen35_causal_lm, "qwen3-next": qwen3_next_causal_lm}
# every policy on one family; the other runs the two-stage path and the fixed length
CASES = [("qwen3.5-moe", p) for p in (*POLICIES, "w=16", "w=2", "uncalibrated")] + [
    ("qwen3-next", "hybridspec"), ("qwen3-next", "w=16")]


@pytest.fixture(scope="module")
def models():
    built = {name: build(seed=11) for name, build in BUILDERS.items()}
    yield built
    for model in built.values():
        hybridspec.disable(model)


@pytest.fixture(scope="module", params=list(BUILDERS))
def pair(request, models):
    return models[request.param], random_drafter(seed=2)


def reference(model, seed: int, **kwargs):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (1, 3 + seed % 9), generator=g)
    hybridspec.disable(model)
    ref = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, **kwargs)
    hybridspec.enable(model)
    return prompt, ref


def both_loops(model, drafter, prompt, ref, seed, **kwargs):
    """The same call on the runner and on the reference loop, from the same global seed (the
    replay drafter's draws come from it, a fixed amount per round)."""
    replay = DeviceReplayDrafter(drafter, ref[0, prompt.shape[1]:])
    outs = []
    for reference_loop in (False, True):
        torch.manual_seed(seed)
        outs.append(model.generate(prompt, assistant_model=replay, hybridspec=True, max_new_tokens=MAX_NEW,
                                   do_sample=False, return_dict_in_generate=True, reference_loop=reference_loop,
                                   **kwargs))
    return outs


@pytest.mark.parametrize("family,policy", CASES)
def test_runner_equals_target_only_and_the_reference_loop(models, family, policy):
    model, drafter = models[family], random_drafter(seed=2)
    if policy.startswith("w="):
        kwargs = dict(verify_length=int(policy[2:]))
    elif policy == "uncalibrated":
        kwargs = dict(policy="hybridspec")
    else:
        kwargs = dict(policy=policy, calibration=synthetic_calibration(model, DeviceReplayDrafter(drafter, torch.zeros(0))))
    for seed in range(2):
        prompt, ref = reference(model, seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fast, slow = both_loops(model, drafter, prompt, ref, seed, **kwargs)
        assert torch.equal(fast.sequences, ref), f"{policy}, seed {seed}"
        assert torch.equal(slow.sequences, ref)
        # same lengths, same acceptance, round for round
        assert fast.hybridspec_stats == slow.hybridspec_stats, f"{policy}, seed {seed}"
        assert max(fast.hybridspec_stats.accepted) > (0 if policy == "w=2" else 2)
    assert getattr(model, "_hybridspec_runner") is not None


def test_runner_stops_at_eos_inside_a_block(pair):
    model, drafter = pair
    prompt, ref = reference(model, 1)
    # an EOS id that occurs in the middle of the continuation
    eos = int(ref[0, prompt.shape[1] + 17])
    prompt, ref = reference(model, 1, eos_token_id=eos, pad_token_id=0)
    fast, slow = both_loops(model, drafter, prompt, ref, 1, verify_length=16, eos_token_id=eos, pad_token_id=0)
    assert ref.shape[1] < prompt.shape[1] + MAX_NEW and ref[0, -1] == eos
    assert torch.equal(fast.sequences, ref) and torch.equal(slow.sequences, ref)
    assert fast.hybridspec_stats == slow.hybridspec_stats


def test_runner_streams_what_it_returns(pair):
    model, drafter = pair
    prompt, ref = reference(model, 2)

    class Recorder(TextStreamer):
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen.extend(value.flatten().tolist())

        def end(self):
            self.seen.append("end")

    streamer = Recorder()
    replay = DeviceReplayDrafter(drafter, ref[0, prompt.shape[1]:])
    out = model.generate(prompt, assistant_model=replay, hybridspec=True, max_new_tokens=MAX_NEW, do_sample=False,
                         streamer=streamer, verify_length=8)
    assert torch.equal(out, ref)
    # transformers puts the prompt first, then every new token once
    assert streamer.seen == ref[0].tolist() + ["end"]


def test_both_loops_time_the_first_token_apart_from_the_rounds(pair):
    model, drafter = pair
    prompt, ref = reference(model, 5)
    runner_out, loop_out = both_loops(model, drafter, prompt, ref, 5, verify_length=8)
    for out, ahead in ((runner_out, True), (loop_out, False)):
        assert torch.equal(out.sequences, ref)
        stats = out.hybridspec_stats
        assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
        # the runner counts the rounds it launched; the reference loop launches none ahead
        assert (stats.launched > 0) == ahead


def test_autoregressive_runner_equals_target_only(pair):
    model, _ = pair
    prompt, ref = reference(model, 4)
    runner = Runner(model, capacity=64)
    out, stats = runner.generate(prompt, MAX_NEW)
    assert torch.equal(out, ref)
    assert set(stats.verify_lengths) == {1} and set(stats.accepted) == {0}
    with pytest.raises(ValueError, match="capacity 64"):
        runner.generate(prompt, 64)


def test_autoregressive_runner_with_the_gated_verify_equals_target_only(pair, monkeypatch):
    """`VERIFY_CONFIG["gated_one_row"]` on: each GDN layer's one-row step verifies and normalises in
    `gdn_verify_gated` (its naive twin here), and the tokens are still the target's."""
    from hybridspec.ops import gdn as gdn_mod
    from hybridspec.patches import common

    model, _ = pair
    prompt, ref = reference(model, 4)
    calls = []
    gated = common.gdn_verify_gated
    monkeypatch.setattr(common, "gdn_verify_gated", lambda *a, **k: calls.append(a[0].shape) or gated(*a, **k))
    monkeypatch.setitem(gdn_mod.VERIFY_CONFIG, "gated_one_row", 1)
    out, _ = Runner(model, capacity=64).generate(prompt, MAX_NEW)
    assert torch.equal(out, ref)
    layers = model.config.get_text_config().layer_types.count("linear_attention")
    assert len(calls) >= layers and all(shape[1] == 1 for shape in calls)


@pytest.mark.parametrize("fused", [1, 0])
def test_autoregressive_runner_with_and_without_the_fused_prologue_equals_target_only(pair, monkeypatch, fused):
    """`PROLOGUE_CONFIG["fused"]` on (the default): each attention layer's norms, rotary and KV
    write run as `attention_prologue` (its naive twin here); off, as the modules; the tokens are the
    target's either way."""
    from hybridspec.ops import prologue
    from hybridspec.patches import common

    model, _ = pair
    prompt, ref = reference(model, 4)
    calls = []
    op = common.attention_prologue
    monkeypatch.setattr(common, "attention_prologue", lambda *a, **k: calls.append(a[0].shape) or op(*a, **k))
    monkeypatch.setitem(prologue.PROLOGUE_CONFIG, "fused", fused)
    out, _ = Runner(model, capacity=64).generate(prompt, MAX_NEW)
    assert torch.equal(out, ref)
    layers = model.config.get_text_config().layer_types.count("full_attention")
    assert (len(calls) >= layers) if fused else not calls


def test_calls_the_runner_cannot_serve_run_the_reference_loop(pair):
    model, drafter = pair
    prompt, ref = reference(model, 3, repetition_penalty=1.3)
    replay = DeviceReplayDrafter(drafter, ref[0, prompt.shape[1]:])
    model._hybridspec_runner = None
    out = model.generate(prompt, assistant_model=replay, hybridspec=True, max_new_tokens=MAX_NEW, do_sample=False,
                         repetition_penalty=1.3, verify_length=8)
    assert torch.equal(out, ref)
    assert model._hybridspec_runner is None
    out = model.generate(prompt, assistant_model=replay, hybridspec=True, max_new_tokens=4, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, verify_length=8)
    assert len(out.scores) == 4 and model._hybridspec_runner is None


def test_runner_is_reused_across_calls(pair):
    model, drafter = pair
    prompt, ref = reference(model, 5)
    replay = DeviceReplayDrafter(drafter, ref[0, prompt.shape[1]:])
    runs = []
    for _ in range(2):
        runs.append(model.generate(prompt, assistant_model=replay, hybridspec=True, max_new_tokens=MAX_NEW,
                                   do_sample=False, verify_length=4))
        runs.append(model._hybridspec_runner)
    assert torch.equal(runs[0], ref) and torch.equal(runs[2], ref)
    assert runs[1] is runs[3]
    # another length policy is another captured round
    model.generate(prompt, assistant_model=replay, hybridspec=True, max_new_tokens=MAX_NEW, do_sample=False,
                   verify_length=5)
    assert model._hybridspec_runner is not runs[1]


def test_forced_replay_takes_the_drawn_acceptance(pair):
    """The benchmark mode: accept lengths come from the replay draws and the tokens are the
    continuation, on the runner and on the reference loop alike."""
    model, drafter = pair
    prompt, ref = reference(model, 6)
    # a continuation the target would not produce: forcing must not consult the target
    continuation = (ref[0, prompt.shape[1]:] + 1) % VOCAB
    replay = DeviceReplayDrafter(drafter, continuation)
    rule = ForcedAcceptance(replay)
    outs = []
    for reference_loop in (False, True):
        torch.manual_seed(3)
        outs.append(model.generate(prompt, assistant_model=replay, hybridspec=True, max_new_tokens=MAX_NEW,
                                   do_sample=False, return_dict_in_generate=True, verify_length=16,
                                   reference_loop=reference_loop, hybridspec_accept=rule))
    for out in outs:
        # the first token is the prefill's own; the rounds emit the continuation after it
        assert torch.equal(out.sequences[0, : prompt.shape[1] + 1], ref[0, : prompt.shape[1] + 1])
        assert torch.equal(out.sequences[0, prompt.shape[1] + 1 :], continuation[1:])
    assert outs[0].hybridspec_stats == outs[1].hybridspec_stats
    assert max(outs[0].hybridspec_stats.accepted) > 2


def test_forced_rounds_take_the_fused_head_as_greedy_rounds_do(pair, monkeypatch):
    """The forced rule reads no score (a `Top1AcceptRule`), so the runner's rounds under it take the
    fused head's top-1 instead of the logits, as plain greedy rounds do (what the benchmark times
    is then the path a greedy call runs), with the same rounds and tokens as with the logits; a
    sampling call keeps the logits."""
    from hybridspec.policy import FixedPolicy
    from hybridspec.round.round import Sampler

    calls = count_top1(monkeypatch)
    model, drafter = pair
    prompt, ref = reference(model, 6)
    drafter.bind(model)
    replay = DeviceReplayDrafter(drafter, (ref[0, prompt.shape[1]:] + 1) % VOCAB, vocab_size=VOCAB)
    rule = ForcedAcceptance(replay)
    runs = []
    for fused in (True, False):
        calls.clear()
        runner = Runner(model, replay, FixedPolicy("fixed", 16), capacity=64, sampler=Sampler(False, rule=rule),
                        fused_head=fused)
        assert runner.round.fused_head == fused
        torch.manual_seed(3)
        runs.append(runner.generate(prompt, MAX_NEW))
        assert bool(calls) == fused
    (fast, fast_stats), (slow, slow_stats) = runs
    assert torch.equal(fast, slow) and fast_stats == slow_stats and max(fast_stats.accepted) > 2
    sampled = Runner(model, replay, FixedPolicy("fixed", 16), capacity=64, sampler=Sampler(True, rule=rule))
    assert not sampled.round.fused_head
    # a custom rule that may read the scores keeps the logits
    from hybridspec.round.accept import greedy_accept

    custom = Runner(model, replay, FixedPolicy("fixed", 16), capacity=64, sampler=Sampler(False, rule=greedy_accept))
    assert not custom.round.fused_head


def test_a_weight_replaced_between_calls_makes_the_runner_capture_again():
    """A captured graph reads the weights at their addresses: a parameter replaced between calls (of
    the target, fused or not, or of the drafter) must give a new capture, and nothing else does."""
    from hybridspec.policy import FixedPolicy

    model, drafter = qwen35_causal_lm(), random_drafter()
    drafter.bind(model)
    runner = Runner(model, drafter, FixedPolicy("fixed", 4), capacity=64)
    prompt = torch.arange(1, 9)[None]
    runner.generate(prompt, 4)
    step = runner.step
    runner.generate(prompt, 4)
    assert runner.step is step, "nothing moved: the same capture serves the next call"
    layers = model.model.layers
    fused = layers[0].linear_attn.in_proj_z  # re-linked in place: the same fused buffer, no new capture
    for lin, recaptures in ((layers[3].self_attn.o_proj, True), (fused, False), (drafter.layers[0].mlp.down_proj, True)):
        lin.weight = torch.nn.Parameter(lin.weight.detach().clone())
        runner.generate(prompt, 4)
        assert (runner.step is not step) == recaptures, lin
        step = runner.step


@pytest.mark.parametrize("drafting", [False, True])
def test_the_fused_head_gives_the_logits_argmax(pair, drafting, monkeypatch):
    """`Runner`'s default `fused_head=True`: plain greedy rounds (and AR steps) take each position's
    argmax from `lm_head_top1` instead of the logits, and still emit target-only decoding's tokens;
    a sampler with warpers or sampling keeps the logits, as does `fused_head=False`."""
    from hybridspec.policy import FixedPolicy
    from hybridspec.round.round import Sampler

    calls = count_top1(monkeypatch)
    model, drafter = pair
    prompt, ref = reference(model, 6)
    drafter.bind(model)
    replay = DeviceReplayDrafter(drafter, ref[0, prompt.shape[1]:], vocab_size=VOCAB) if drafting else None
    policy = FixedPolicy("fixed", 8) if drafting else None
    runner = Runner(model, replay, policy, capacity=64)
    assert runner.fused_head
    if drafting:
        assert runner.round.fused_head
        assert not Runner(model, replay, policy, capacity=64, fused_head=False).round.fused_head
    torch.manual_seed(6)
    out, stats = runner.generate(prompt, MAX_NEW)
    assert torch.equal(out, ref)
    # every round (or step) took its argmax from the fused head
    assert len(calls) >= len(stats.accepted) > 0
    if drafting:
        assert max(stats.accepted) > 2
        sampled = Runner(model, replay, policy, capacity=64, sampler=Sampler(do_sample=True))
        assert not sampled.round.fused_head


def calibrated_replay(pair, seed: int):
    """(model, prompt, target-only reference, replay drafter over it, the calibrated HybridSpec
    policy with its routing correction) for a test of the runner's compiled parts."""
    from hybridspec.policy import from_calibration

    model, drafter = pair
    prompt, ref = reference(model, seed)
    drafter.bind(model)
    replay = DeviceReplayDrafter(drafter, ref[0, prompt.shape[1]:], vocab_size=VOCAB)
    return model, prompt, ref, replay, from_calibration("hybridspec", synthetic_calibration(model, replay), 128)


def test_the_compiled_front_gives_the_eager_rounds(pair):
    """`Runner(compile_front=True)`: the length choice, Stage 0 and the routing correction compiled
    as one region (inductor's CPU code here; the GPU test replays it captured) give the eager
    runner's rounds, lengths and tokens, under the calibrated policy with its correction."""
    from hybridspec.round.round import front

    model, prompt, ref, replay, policy = calibrated_replay(pair, 7)
    runs = []
    for compiled in (False, True):
        runner = Runner(model, replay, policy, capacity=64, compile_front=compiled)
        assert (runner.round.front is front) != compiled
        torch.manual_seed(7)
        runs.append(runner.generate(prompt, MAX_NEW))
    (eager, eager_stats), (fast, fast_stats) = runs
    assert torch.equal(eager, ref) and torch.equal(fast, ref)
    assert fast_stats == eager_stats and len(set(eager_stats.verify_lengths)) > 1
    # the compiled correct's second output too (not part of the stats' equality), and the correction fired
    assert fast_stats.layer0_experts == eager_stats.layer0_experts
    assert any(w > w0 for w, w0 in zip(eager_stats.verify_lengths, eager_stats.nominal_lengths))
    with pytest.raises(ValueError, match="compile_front needs the fixed graph"):
        Runner(model, replay, policy, capacity=64, dispatch="cond", compile_front=True)
    assert Runner(model, replay, policy, capacity=64).round.front is front


def test_compiled_blocks_run_stage0_rope_and_final_norm(pair):
    """Where the runner compiles the layers, Stage 0 runs Layer 0 through the compiled
    `Blocks.layer0` (inductor's CPU code here), eagerly or inside the compiled front, the stack's
    RoPE and final norm through `Blocks.rope` and `Blocks.norm`, and the commit and output writes
    as compiled regions, with no graph break: the rounds,
    lengths and tokens of the eager runner under the calibrated policy, and the AR runner's tokens."""
    from torch._dynamo.utils import counters

    from hybridspec.patches.forward import EAGER, layer0_block
    from hybridspec.runner.io import write_outputs
    from hybridspec.state import commit_buffers

    model, prompt, ref, replay, policy = calibrated_replay(pair, 9)
    runs = []
    for compiled, front in ((False, False), (True, False), (True, True)):
        runner = Runner(model, replay, policy, capacity=64, compile=compiled, compile_front=front)
        blocks = runner.target.blocks
        assert (blocks.layer0 is layer0_block) != compiled
        # the commit and the output writes run as compiled regions of their own where the layers do
        assert (runner.state.commit_fn is commit_buffers) != compiled
        assert (runner.io.finish_fn is write_outputs) != compiled
        calls = []

        def layer0(*args, blocks=blocks, calls=calls):
            calls.append(args[2].shape[1])
            return blocks.layer0(*args)

        runner.target.blocks = blocks._replace(layer0=layer0)
        counters.clear()
        torch.manual_seed(9)
        runs.append(runner.generate(prompt, MAX_NEW))
        assert not counters["graph_break"], dict(counters["graph_break"])
        # every round ran Stage 0 over the whole block, through the blocks' layer0
        assert calls and set(calls) == {runner.width}
    (eager, eager_stats), *compiled_runs = runs
    assert torch.equal(eager, ref)
    for out, stats in compiled_runs:
        assert torch.equal(out, ref) and stats == eager_stats
    counters.clear()
    ar = Runner(model, capacity=64, compile=True)
    assert ar.target.blocks.rope is not EAGER.rope and ar.target.blocks.norm is not EAGER.norm
    assert ar.state.commit_fn is not commit_buffers and ar.io.finish_fn is not write_outputs
    out, _ = ar.generate(prompt, MAX_NEW)
    assert torch.equal(out, ref) and not counters["graph_break"]


def test_every_runner_compiles_its_own_front(pair):
    """Dynamo counts recompiles per code object, and with fullgraph the ninth fails: runners of
    other policies (each a recompile of a shared `front`) would fail from the ninth on. Each round
    compiles its own copy, so a process may build any number of them."""
    from hybridspec.policy import FixedPolicy

    model, drafter = pair
    prompt, ref = reference(model, 8)
    drafter.bind(model)
    replay = DeviceReplayDrafter(drafter, ref[0, prompt.shape[1]:], vocab_size=VOCAB)
    fronts = set()
    for length in (16, 15, 14, 13, 12, 11, 10, 9, 8, 7):
        runner = Runner(model, replay, FixedPolicy("fixed", length), capacity=64, compile_front=True)
        out, _ = runner.generate(prompt, 8)
        assert torch.equal(out, ref[:, : out.shape[1]])
        fronts.add(runner.round.front)
    assert len(fronts) == 10
