"""`benchmarks/batched_ceiling.py`: the simulator against the replay model's closed form, the
policies' order, the cost models read from a bench and a split, and the labelled JSON it writes."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from benchmarks import batched_ceiling as ceiling
from hybridspec.sim.replay import BETA_A, BETA_B


def expected_emitted(w: int) -> float:
    """E[min(a + 1, w)] under the replay model: sum over i < w of E[c^i], c ~ Beta(a, b)."""
    from math import lgamma, exp

    def beta(x, y):
        return lgamma(x) + lgamma(y) - lgamma(x + y)

    return sum(exp(beta(BETA_A + i, BETA_B) - beta(BETA_A, BETA_B)) for i in range(w))


def test_steady_state_fixed_length_emits_the_closed_form():
    # Beta(5, 2): sum_{i<16} 30 / ((5+i)(6+i)) = 30 (1/5 - 1/21) = 4.571 tokens per row and round
    assert expected_emitted(16) == pytest.approx(30 * (1 / 5 - 1 / 21))
    rng = np.random.default_rng(0)
    for w in (4, 16):
        got = ceiling.simulate(rng, {w: 1.0}, str(w), 0.0, B=4, budget=None, rounds=20000)
        assert got / 4 == pytest.approx(expected_emitted(w), rel=0.02)


def test_a_length_past_every_budget_verifies_the_largest_budget():
    # one row with 3 tokens left: w = 16 runs as w = 3, priced on the curve between 2 and 4
    rng = np.random.default_rng(5)
    cost = {2: 2.0, 4: 4.0, 16: 100.0}
    got = [ceiling.simulate(rng, cost, "16", 0.0, B=1, budget=3, rounds=1) for _ in range(200)]
    # emitted 1..3 tokens in 3 ms: never the 100 ms of a full w = 16 round
    assert min(got) >= 1 / 3 - 1e-9 and max(got) <= 1.0 + 1e-9


def test_the_bench_regime_never_emits_past_a_budget():
    # rows of 10 tokens: one round of w = 16 (1 ms) emits at most the two budgets; w = 1 emits one
    # token per live row per round, and every row lives for exactly its budget's rounds
    rng = np.random.default_rng(1)
    for _ in range(50):
        assert 2 <= ceiling.simulate(rng, {16: 1.0}, "16", 0.0, B=2, budget=10, rounds=1) <= 20
    assert ceiling.simulate(rng, {1: 1.0}, "1", 0.0, B=2, budget=10, rounds=5000) == pytest.approx(2.0)


def test_clairvoyant_is_at_least_the_best_fixed_length():
    # at rho = the best fixed throughput, argmax(gain - rho cost) per round cannot do worse in expectation
    cost = {2: 3.0, 4: 3.5, 8: 4.5, 16: 6.5}
    rng = np.random.default_rng(2)
    fixed = max(ceiling.simulate(rng, cost, str(w), 0.0, 4, None, 4000) for w in cost)
    clair, _, _ = ceiling.best(rng, cost, "clairvoyant", 4, None, 4000)
    knows, _, _ = ceiling.best(rng, cost, "knows c", 4, None, 4000)
    confident, rho, edge = ceiling.best(rng, cost, "knows c + confidences", 4, None, 4000)
    assert not edge and rho > 0
    assert clair >= fixed * 0.99 and clair >= knows * 0.99
    # the confidences say more than c alone, less than the outcomes
    assert knows * 0.99 <= confident <= clair * 1.01


def test_the_posterior_is_calibrated():
    # given c and the confidences the drafts are independent, so E[prod_{j<i} p_j] = P(first i right) = E[c^i]
    rng = np.random.default_rng(4)
    draws = [ceiling.accepted_lengths(rng, 64, 15) for _ in range(400)]
    posterior = np.concatenate([d[2] for d in draws])
    leading = np.concatenate([d[1] for d in draws])
    for i in (1, 2, 4, 8):
        moment = expected_emitted(i + 1) - expected_emitted(i)  # E[c^i]
        assert np.cumprod(posterior, 1)[:, i - 1].mean() == pytest.approx(moment, abs=0.01)
        assert (leading >= i).mean() == pytest.approx(moment, abs=0.01)
    assert np.isfinite(posterior).all() and ((posterior >= 0) & (posterior <= 1)).all()


def bench_files(tmp_path, bound_at=(1, 2, 4, 8, 12, 16)):
    bench = dict(batch_size=4, max_new_tokens=32,
                 rows=[dict(method="AR (ours)", tokens_per_s=800.0, speedup_vs_ar=1.0),
                       dict(method="HybridSpec", tokens_per_s=1000.0, speedup_vs_ar=1.25)])
    lengths = [2, 4, 8, 12, 16]
    calibration = dict(batches=[dict(batch_size=4, lengths=lengths, cost=[8.0 + w / 2 for w in lengths])])
    part = lambda w: dict(gdn=0.5, attention=0.1, moe=1.0 + w / 2, lm_head_accept=0.2, other=0.0, drafter=0.4)
    timed = lambda w: dict(gdn=1.0, attention=0.2, moe=2.0 + w, lm_head_accept=0.3, drafter=0.8, stage0=0.1,
                           stage0_compiled=0.05)
    split = dict(batch_split=dict(batch_size=4, bound_ms={str(w): part(w) for w in bound_at},
                                  split={str(w): timed(w) for w in bound_at}))
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "calibration.json").write_text(json.dumps(calibration))
    (tmp_path / "split.json").write_text(json.dumps(split))
    return bench, calibration, split


def test_costs_reads_both_models(tmp_path):
    bench, calibration, split = bench_files(tmp_path)
    models, interpolated = ceiling.costs(bench, calibration, split["batch_split"])
    assert interpolated == []
    ar_ms, measured = models["calibration"]
    assert ar_ms == pytest.approx(4 / 800.0 * 1e3) and measured.full[8] == 12.0
    assert models["split"][0] == ar_ms
    assert models["split"][1].full[4] == pytest.approx(1.0 + 0.2 + 6.0 + 0.3 + 0.8 + 0.1)  # stage0 as the round runs it
    ar_bound, rounds = models["bytes bound"]
    assert ar_bound == pytest.approx(0.5 + 0.1 + 1.5 + 0.2)  # w = 1, no drafter
    assert rounds.full[16] == pytest.approx(0.5 + 0.1 + 9.0 + 0.2 + 0.4)


def test_a_split_without_the_policy_lengths_names_the_command_or_interpolates(tmp_path):
    bench, calibration, split = bench_files(tmp_path, bound_at=(1, 4, 8, 16))
    with pytest.raises(SystemExit, match=r"no bound at w = \[2, 12\].*--split-at 1,2,4,8,12,16.*--interpolate"):
        ceiling.costs(bench, calibration, split["batch_split"])
    models, interpolated = ceiling.costs(bench, calibration, split["batch_split"], interpolate=True)
    assert interpolated == [2, 12]
    # moe is linear in w here, so the chord is exact
    assert models["bytes bound"][1].full[12] == pytest.approx(0.5 + 0.1 + 7.0 + 0.2 + 0.4)
    assert models["split"][1].full[2] == pytest.approx(1.0 + 0.2 + 4.0 + 0.3 + 0.8 + 0.1)
    bench_files(tmp_path, bound_at=(4, 8, 16))
    split = json.loads((tmp_path / "split.json").read_text())
    with pytest.raises(SystemExit, match=r"no bound at w = \[1, 2, 12\]"):
        ceiling.costs(bench, calibration, split["batch_split"], interpolate=True)


def test_main_writes_a_table_labelled_simulated(tmp_path, monkeypatch, capsys):
    bench_files(tmp_path)
    out = tmp_path / "ceiling.json"
    monkeypatch.setattr(sys, "argv", ["batched_ceiling", "--bench", str(tmp_path), "--split", str(tmp_path / "split.json"),
                                      "--rounds", "200", "--out", str(out)])
    ceiling.main()
    assert "acceptance: simulated" in capsys.readouterr().out
    got = json.loads(out.read_text())
    assert got["simulated"] is True and got["acceptance"].startswith("simulated")
    assert got["decoded_tokens_per_row"] == 31  # the bench's first token comes from the prefill
    policies = {(r["cost_model"], r["policy"]) for r in got["rows"]}
    assert ("bytes bound", "clairvoyant") in policies and ("split", "fixed w=16") in policies
    assert ("split", "knows c + confidences") in policies and ("split", "calibrated") in policies
    assert all(np.isfinite(r["bench_regime"]) and r["bench_regime"] > 0 for r in got["rows"])


def test_another_beta_is_labelled_a_what_if(tmp_path, monkeypatch):
    import argparse

    assert ceiling.beta_arg("9,1") == (9.0, 1.0)
    for bad in ("9", "9,x", "0,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            ceiling.beta_arg(bad)
    assert ceiling.acceptance_label((float(BETA_A), float(BETA_B))).startswith("simulated: the replay model")
    assert "what-if" in ceiling.acceptance_label((9.0, 1.0))
    # a drafter that is almost always right emits more per round than the replay model's
    rng = np.random.default_rng(3)
    high = ceiling.simulate(rng, {16: 1.0}, "16", 0.0, 4, None, 2000, beta=(50.0, 1.0))
    assert high > ceiling.simulate(rng, {16: 1.0}, "16", 0.0, 4, None, 2000) * 1.5
    bench_files(tmp_path)
    out = tmp_path / "what-if.json"
    monkeypatch.setattr(sys, "argv", ["batched_ceiling", "--bench", str(tmp_path), "--split", str(tmp_path / "split.json"),
                                      "--rounds", "100", "--beta", "9,1", "--out", str(out)])
    ceiling.main()
    got = json.loads(out.read_text())
    assert got["beta"] == [9.0, 1.0] and "what-if" in got["acceptance"]


def test_a_round_with_fewer_rows_counted_pays_its_moe_at_those_rows(tmp_path):
    bench, calibration, split = bench_files(tmp_path)
    models, _ = ceiling.costs(bench, calibration, split["batch_split"])
    cost = models["split"][1]
    # every row counts w: the full price; one live row of 4 at w = 8 counts 8 + 3 rows
    assert cost.at(8, 32) == pytest.approx(cost.full[8])
    moe_at = lambda rows: 2.0 + rows / 4  # the split's moe part, 2 + w at 4 w rows
    assert cost.at(8, 11) == pytest.approx(cost.full[8] - moe_at(32) + moe_at(11))
    assert models["calibration"][1].at(8, 11) == 12.0  # no parts: full price
    # the steady state never idles a row, so both pricings agree there
    a = ceiling.simulate(np.random.default_rng(7), cost, "8", 0.0, 4, None, 500)
    b = ceiling.simulate(np.random.default_rng(7), ceiling.Cost(cost.full), "8", 0.0, 4, None, 500)
    assert a == pytest.approx(b)
    # the bench's tail is cheaper with the rows priced
    a = ceiling.simulate(np.random.default_rng(8), cost, "16", 0.0, 4, 40, 2000)
    b = ceiling.simulate(np.random.default_rng(8), ceiling.Cost(cost.full), "16", 0.0, 4, 40, 2000)
    assert a > b


def test_the_fitted_overhead_matches_the_measured_ratio(tmp_path):
    bench, calibration, split = bench_files(tmp_path)
    models, _ = ceiling.costs(bench, calibration, split["batch_split"])
    ar_ms, cost = models["split"]
    free = ceiling.simulate(np.random.default_rng(9), cost, "16", 0.0, 4, 31, 2000) * ar_ms / 4
    extra = ceiling.fit_overhead(cost, free * 0.8, ar_ms, 4, 31, 2000, seed=9)
    assert extra > 0
    slowed = ceiling.replace(cost, overhead_ms=extra)
    assert ceiling.simulate(np.random.default_rng(9), slowed, "16", 0.0, 4, 31, 2000) * ar_ms / 4 == pytest.approx(free * 0.8, rel=1e-3)
    # a ratio the parts already fall short of needs no overhead
    assert ceiling.fit_overhead(cost, free * 1.2, ar_ms, 4, 31, 2000, seed=9) == 0.0
