"""Per-round timings and the `full` flag of `HybridSpecStats`, and the calibration's round time that
counts full rounds only: a round where a row had stopped, or had less than w tokens of budget,
verified fewer rows and must not stand for the length's cost."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import hybridspec
from hybridspec.calibration.capture import full_round_seconds, mean_round_ms
from hybridspec.round.stats import HybridSpecStats
from hybridspec.sim.replay import DeviceReplayDrafter
from tests.generation.test_batched import PAD, padded_batch, target_only
from tests.models import VOCAB, qwen35_causal_lm, random_drafter

MAX_NEW = 20


@pytest.fixture(scope="module")
def model():
    m = hybridspec.enable(qwen35_causal_lm(seed=11))
    yield m
    hybridspec.disable(m)


@pytest.fixture(scope="module")
def gpu_model():
    m = hybridspec.enable(qwen35_causal_lm(seed=11).cuda())
    yield m
    hybridspec.disable(m)


def expected_full(stats: HybridSpecStats, produced: list[int]) -> tuple[list[bool], int]:
    """Replay the rounds from the per-row kept drafts (rows still emitting, in row order): a round
    is full when every row is still emitting and has at least w tokens of its budget left. `produced`:
    each row's tokens in all, the first included (up to its EOS or the limit). Also returns how many
    rounds were not full by a budget alone (every row emitting, one with less than w left)."""
    emitted, kept = [1] * len(produced), iter(stats.accepted)
    flags, by_budget = [], 0
    for w in stats.verify_lengths:
        active = [b for b in range(len(produced)) if emitted[b] < produced[b]]
        budget_ok = all(MAX_NEW - emitted[b] >= w for b in active)
        flags.append(len(active) == len(produced) and budget_ok)
        by_budget += len(active) == len(produced) and not budget_ok
        for b in active:
            emitted[b] += next(kept) + 1
    assert emitted == produced and next(kept, None) is None
    return flags, by_budget


@pytest.mark.parametrize("stop", ["eos", "limit"])
@pytest.mark.parametrize("loop", ["reference", "runner"])
def test_full_flags_and_round_seconds(model, loop, stop):
    loop_args = dict(reference_loop=True) if loop == "reference" else dict(enforce_eager=True)
    check_round_stats(model, stop, loop_args, budget_case=stop == "limit")


@pytest.mark.gpu
@pytest.mark.parametrize("stop", ["eos", "limit"])
def test_captured_round_seconds_from_events(gpu_model, stop):
    # the captured runner times each round with CUDA events instead of the host clock
    # (GPU arithmetic may accept other drafts than the CPU's: rounds short of budget are not required)
    check_round_stats(gpu_model, stop, {}, budget_case=False)
    assert getattr(gpu_model, "_hybridspec_runner_b2").captured


def check_round_stats(model, stop, loop_args, budget_case: bool):
    ids, mask = (t.to(model.device) for t in padded_batch(2, seed=5))
    P = ids.shape[1]
    free = target_only(model, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None)
    # "eos": row 0 stops at its 6th token and row 1 runs to the limit (unless it emits that id too);
    # "limit": both run to the limit, so the last rounds are not full by budget alone
    eos = int(free[0, P + 5]) if stop == "eos" else None
    drafts = free[:, P:].clone()
    # a wrong draft in row 1 puts the rows out of step, so near the limit one row has less budget
    # left than the batch's length (capped only by the largest budget left)
    drafts[1, 2] = (drafts[1, 2] + 1) % VOCAB
    replay = DeviceReplayDrafter(random_drafter().to(model.device), drafts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                         pad_token_id=PAD, assistant_model=replay, hybridspec=True, return_dict_in_generate=True,
                         verify_length=6, **loop_args)
    stats = out.hybridspec_stats
    produced = []
    for row in out.sequences[:, P:].tolist():
        produced.append(row.index(eos) + 1 if eos is not None and eos in row else len(row))
    flags, by_budget = expected_full(stats, produced)
    assert stats.full == flags
    assert by_budget > 0 or not budget_case
    # both kinds occur: full rounds first, then rounds after row 0's EOS or near the limit
    assert flags[0] and not flags[-1]
    assert len(stats.round_seconds) == stats.rounds
    assert all(math.isfinite(s) and s > 0 for s in stats.round_seconds)
    assert sum(stats.round_seconds) <= stats.decode_seconds * 1.01


@pytest.mark.parametrize("loop", [dict(reference_loop=True), dict(enforce_eager=True)])
def test_a_round_capped_by_the_budget_does_not_time_the_length(model, loop):
    # B = 1 at 20 tokens and w = 6: the fixed length is capped by the budget left, so the last
    # round verifies fewer rows, all of them its own: full, but no round of w = 6 (found in review)
    ids, mask = padded_batch(1, seed=5)
    P = ids.shape[1]
    free = target_only(model, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None)
    replay = DeviceReplayDrafter(random_drafter(), free[:, P:].clone())
    out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=PAD, assistant_model=replay, hybridspec=True, return_dict_in_generate=True,
                         verify_length=6, **loop)
    stats = out.hybridspec_stats
    short = [i for i, w in enumerate(stats.verify_lengths) if w < 6]
    assert short and all(stats.full[i] for i in short)
    timed = full_round_seconds(stats, 6)
    assert timed == [t for t, w in zip(stats.round_seconds, stats.verify_lengths) if w == 6]
    assert len(timed) == len(stats.verify_lengths) - len(short)


class _Stub:
    """A model whose `generate` hands back prepared statistics, one call after another."""

    def __init__(self, stats: list[HybridSpecStats]):
        self.stats = list(stats)

    def generate(self, ids, **kwargs):
        return SimpleNamespace(hybridspec_stats=self.stats.pop(0))


def _stats(seconds, full) -> HybridSpecStats:
    s = HybridSpecStats()
    for t, f in zip(seconds, full):
        s.record(4, 4, [0], 0, seconds=t, full=f)
    return s


def test_mean_round_ms_counts_full_rounds_after_the_warm_up():
    calls = [(torch.zeros(1, 2, dtype=torch.long), None, None)] * 3
    warm = _stats([1.0, 1.0], [True, True])
    a = _stats([0.004, 0.006, 0.001], [True, True, False])
    b = _stats([0.008, 0.0005], [True, False])
    b.record(3, 4, [0], 0, seconds=0.0001, full=True)  # capped by the budget: full, but not a w = 4 round
    got = mean_round_ms(_Stub([warm, a, b]), None, calls, "t", verify_length=4)
    assert got == pytest.approx(6.0)  # (4 + 6 + 8) / 3 ms


def test_mean_round_ms_without_a_full_round_raises():
    calls = [(torch.zeros(1, 2, dtype=torch.long), None, None)] * 2
    stub = _Stub([_stats([0.01], [True]), _stats([0.002, 0.001], [False, False])])
    with pytest.raises(ValueError, match="no timed round verified every row's 4 tokens.*max-new-tokens"):
        mean_round_ms(stub, None, calls, "timing w = 16", verify_length=4)
