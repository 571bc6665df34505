"""`hybridspec bench`: noise flags on synthetic timings, the cost-fit flag, forced rows, plots that
say what they show, warnings left visible, and a small end-to-end run on the tiny models."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import matplotlib
import pytest
import torch

from hybridspec import bench
from hybridspec.bench_plots import TITLE_WIDTH, cost_figure, speedup_figure
from hybridspec.bench_report import COLUMNS, _cell, noise_reasons, spread
from hybridspec.calibration.costs import cost_fit_noise, fit_round_cost
from hybridspec.cli import build_parser
from hybridspec.round.stats import HybridSpecStats
from tests.calibration.test_artifact import calibration

matplotlib.use("Agg")


def test_spread():
    assert spread([10.0]) == 0
    assert spread([9.0, 10.0, 12.0]) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        spread([1.0, 0.0])


def test_noise_flags_on_synthetic_timings():
    stable, ar = [100.0, 103.0, 98.0], [50.0, 51.0, 49.5]
    assert noise_reasons(stable, ar) == []
    # one repeat hit by load: the row's own spread flags it
    reasons = noise_reasons([100.0, 300.0, 90.0], ar)
    assert len(reasons) == 1 and reasons[0].startswith("tokens/s spread 210% over 3 repeats")
    # a stable row over a noisy baseline: its ratio is noisy all the same
    assert noise_reasons(stable, [50.0, 20.0, 51.0]) == ["the AR baseline's tokens/s spread 62% (> 25%)"]
    assert noise_reasons(stable, ar, calibration_noise="RMS residual 863 ms")[-1] == (
        "calibration cost fit noisy: RMS residual 863 ms")
    # the AR row's own: its spread only, not twice
    assert noise_reasons([50.0, 20.0, 51.0]) == ["tokens/s spread 62% over 3 repeats (> 25%)"]
    with pytest.raises(ValueError, match="at least 2 repeats"):
        noise_reasons([100.0], [50.0])


def test_cost_fit_flagged_when_the_residual_rivals_the_curve():
    # the calibration: w = 2 at 2,651 ms, w = 4 at 390 ms on a loaded CPU
    lengths, noisy_ms = [2, 4, 8, 16], [2651.0, 390.0, 410.0, 450.0]
    fit = fit_round_cost(lengths, noisy_ms, max_len=16)
    flag = cost_fit_noise(fit.rms_residual_ms, noisy_ms)
    assert flag["noisy"] and flag["cost_relative_residual"] > 0.5 and "2.65e+03 ms" in flag["noisy_reason"]
    clean = [10 + 0.1 * w + 0.01 * w * w for w in lengths]
    fit = fit_round_cost(lengths, clean, max_len=16)
    flag = cost_fit_noise(fit.rms_residual_ms, clean)
    assert not flag["noisy"] and flag["noisy_reason"] is None and flag["cost_relative_residual"] < 1e-6


def test_forced_rows_show_exactness_as_not_applicable():
    outs = [torch.arange(10)]
    ar = bench._row(bench.AR, outs, [[1.0], [1.1]], None)
    ar["outs"] = outs
    stats = [HybridSpecStats(verify_lengths=[8, 8], nominal_lengths=[8, 8], accepted=[4, 4], decode_seconds=0.4)]
    forced = bench._row("HybridSpec", outs, [[0.4], [0.41]], ar, stats, forced=True, simulated=True)
    assert forced["simulated"] and forced["exact_match_rate"] is None and forced["token_agreement"] is None
    assert _cell("exact_match_rate", None, forced) == "n/a"
    replayed = bench._row("HybridSpec", outs, [[0.4], [0.41]], ar, stats, simulated=True)
    assert replayed["exact_match_rate"] == 1.0 and _cell("exact_match_rate", 1.0, replayed) == "1"
    assert not ar["simulated"] and ar["speedup_vs_ar"] == 1.0


def synthetic_result():
    rows = [dict(method="AR (ours)", simulated=False, noisy=False, speedup_vs_ar=1.0, speedup_vs_ar_range=[1.0, 1.0]),
            dict(method="HybridSpec", simulated=True, noisy=False, speedup_vs_ar=2.0, speedup_vs_ar_range=[1.9, 2.1]),
            dict(method="D-Cut", simulated=True, noisy=True, speedup_vs_ar=1.5, speedup_vs_ar_range=[0.9, 3.0])]
    return dict(rows=rows, repeats=3, models="tiny random Qwen3.5-MoE + DFlash (4 layers, hidden 64)", device="cpu",
                acceptance=dict(model="replay", label="simulated acceptance (replay drafter)",
                                description="simulated: replay drafter (a long description)"),
                prompts=3, max_new_tokens=64, note="CPU run: tiny models are overhead-bound here, so these ratios say "
                                                   "nothing about speedups on a GPU")


def assert_title_clear(fig, ax):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title = ax.title.get_window_extent(renderer)
    assert not title.overlaps(ax.get_legend().get_window_extent(renderer))
    assert not title.overlaps(ax.get_window_extent(renderer))
    assert all(len(line) <= TITLE_WIDTH for line in ax.get_title().splitlines())


def test_speedup_plot_marks_simulated_and_noisy_rows():
    fig = speedup_figure(synthetic_result())
    ax = fig.axes[0]
    from matplotlib.container import BarContainer

    bars = next(c for c in ax.containers if isinstance(c, BarContainer)).patches
    assert [b.get_hatch() for b in bars] == [None, "//", "//"]
    assert bars[2].get_facecolor() != bars[1].get_facecolor()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["measured", "simulated acceptance", "noisy: ratio not meaningful"]
    title = ax.get_title().replace("\n", " ")
    assert "on cpu" in title and "tiny" in title and "simulated acceptance" in title
    assert_title_clear(fig, ax)


def test_cost_plot_shows_measured_points_and_the_fit():
    calib = calibration(summary={"round_ms": {"2": 5.3, "4": 5.9}, "cost_rms_residual_ms": 0.1, "noisy": True,
                                 "noisy_reason": "RMS residual 0.1 ms", "drafter": "DeviceReplayDrafter"})
    fig = cost_figure(calib, synthetic_result())
    ax = fig.axes[0]
    points = [line for line in ax.get_lines() if line.get_marker() == "o"]
    assert len(points) == 1 and list(points[0].get_xdata()) == [2, 4] and list(points[0].get_ydata()) == [5.3, 5.9]
    fitted = [line for line in ax.get_lines() if line.get_label().startswith("fitted")]
    assert len(fitted) == 1 and len(fitted[0].get_xdata()) == len(calib.cost)
    assert "NOISY FIT" in ax.get_title() and "on cpu" in ax.get_title().replace("\n", " ")
    assert_title_clear(fig, ax)


def test_bench_leaves_warnings_visible():
    class Model:
        def generate(self, *args, **kwargs):
            warnings.warn("hybridspec: the runner fell back", UserWarning)
            stats = HybridSpecStats(verify_lengths=[2], nominal_lengths=[2], accepted=[1], decode_seconds=0.1)
            return SimpleNamespace(sequences=torch.zeros(1, 6, dtype=torch.long), hybridspec_stats=stats)

    passes = bench._Passes(Model(), None, [torch.zeros(1, 3, dtype=torch.long)], 3, None, 0, False)
    with pytest.warns(UserWarning, match="fell back"):
        passes.speculative({})


def test_tiny_bench_end_to_end(tmp_path):
    args = build_parser().parse_args(["bench", "--tiny", "--device", "cpu", "--num-prompts", "2", "--max-new-tokens",
                                      "16", "--repeats", "2", "--out", str(tmp_path)])
    result = bench.run(args)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["simulated"] is True and saved["acceptance"]["model"] == "replay"
    assert "CUDA only" in saved["absent_rows"][bench.HF]
    assert set(saved["columns"]) == {key for key, _, _ in COLUMNS}
    rows = {r["method"]: r for r in saved["rows"]}
    assert list(rows) == [bench.AR] + [name for name, _ in bench.METHODS]
    assert rows[bench.AR]["simulated"] is False
    # every row times its first token, and that prefill is not part of its decode seconds
    assert all(r["ttft_ms"] > 0 for r in saved["rows"])
    for name, _ in bench.METHODS:
        row = rows[name]
        assert row["simulated"] is True and len(row["tokens_per_s_repeats"]) == 2 and "noisy" in row
        assert row["noisy"] == bool(row["noise_reasons"])
        # the replay drafter's drafts are accepted by the target's own argmax: exact
        assert row["exact_match_rate"] == 1.0
    assert saved["noisy_rows"] == [r["method"] for r in saved["rows"] if r["noisy"]]
    assert "noisy" in saved["calibration_summary"] and saved["cpu_threads"] == 1
    assert all((tmp_path / name).stat().st_size > 0 for name in ("speedup.png", "cost_curve.png"))
    assert result["plots"]


def test_split_options_hold_for_the_run_only(monkeypatch):
    """`hybridspec bench --out-split-k / --router-split-k / --in-split-k` set `LinearKernelConfig`'s fields for its
    run (before anything compiles) and restore the library's after; without them the config is left
    alone."""
    import argparse

    from hybridspec import bench
    from hybridspec.cli import build_parser
    from hybridspec.ops import linear

    seen = []
    monkeypatch.setattr(bench, "_run", lambda args: seen.append(
        (linear.KERNEL_CONFIG.out_split_k, linear.KERNEL_CONFIG.router_split_k, linear.KERNEL_CONFIG.in_split_k)) or {})
    before = linear.KERNEL_CONFIG
    args = build_parser().parse_args(["bench", "--tiny", "--out-split-k", "3"])
    assert args.out_split_k == 3 and args.router_split_k is None and args.in_split_k is None
    bench.run(args)
    bench.run(build_parser().parse_args(["bench", "--tiny", "--out-split-k", "2", "--router-split-k", "8",
                                         "--in-split-k", "5"]))
    assert seen == [(3, before.router_split_k, before.in_split_k), (2, 8, 5)] and linear.KERNEL_CONFIG is before
    bench.run(argparse.Namespace())
    assert seen[-1] == (before.out_split_k, before.router_split_k, before.in_split_k)
    assert linear.KERNEL_CONFIG is before


def test_methods_keep_the_rows_named(tmp_path):
    """`--methods` runs AR and the rows it names and lists the rest as left out; fixed-length rows
    alone skip the calibration (no cost plot); a policy row calibrates as before."""
    parse = lambda *more: build_parser().parse_args(  # noqa: E731
        ["bench", "--tiny", "--device", "cpu", "--num-prompts", "1", "--max-new-tokens", "8", "--repeats", "2",
         *more])
    saved = bench.run(parse("--methods", "vanilla", "--out", str(tmp_path / "v")))
    assert [r["method"] for r in saved["rows"]] == [bench.AR, bench.METHOD_KEYS["vanilla"]]
    assert saved["calibration_summary"] is None and not (tmp_path / "v" / "cost_curve.png").exists()
    assert saved["absent_rows"][bench.METHOD_KEYS["hybridspec"]] == "left out by --methods"
    saved = bench.run(parse("--methods", "hybridspec,dcut", "--out", str(tmp_path / "h")))
    assert [r["method"] for r in saved["rows"]] == [bench.AR, bench.METHOD_KEYS["hybridspec"], bench.METHOD_KEYS["dcut"]]
    assert saved["calibration_summary"] is not None and (tmp_path / "h" / "cost_curve.png").exists()
    with pytest.raises(SystemExit, match="--methods: unknown \\['vanila'\\]"):
        bench.selected_methods("vanilla,vanila")
