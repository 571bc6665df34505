"""`benchmarks/bench_runner.py --inductor`: the settings it applies are the ones named, parsed to
the setting's type, globally and in the runner's compile options, and a name inductor does not
have stops the run before anything is built."""

from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config

from benchmarks.bench_runner import inductor_settings, linear_config
from hybridspec.ops import dispatch


def test_inductor_settings_are_parsed_and_applied(monkeypatch):
    # monkeypatch restores both after the test
    monkeypatch.setattr(inductor_config, "combo_kernels", False)
    monkeypatch.setattr(inductor_config, "combo_kernel_max_num_args", inductor_config.combo_kernel_max_num_args)
    monkeypatch.setattr(dispatch, "LAYER_OPTIONS", dict(dispatch.LAYER_OPTIONS))
    got = inductor_settings("combo_kernels=1,combo_kernel_max_num_args=100")
    assert got == {"combo_kernels": True, "combo_kernel_max_num_args": 100}
    assert inductor_config.combo_kernels is True and inductor_config.combo_kernel_max_num_args == 100
    assert dispatch.LAYER_OPTIONS["combo_kernels"] is True and dispatch.LAYER_OPTIONS["combo_kernel_max_num_args"] == 100
    inductor_settings("combo_kernels=0")
    assert dispatch.layer_options()["combo_kernels"] is False
    assert inductor_settings("") == {}


def test_an_unknown_inductor_setting_stops_the_run():
    with pytest.raises(SystemExit, match="no setting 'not_a_setting'"):
        inductor_settings("not_a_setting=1")


def test_linear_config_sets_the_named_fields(monkeypatch):
    from hybridspec.ops import linear

    monkeypatch.setattr(linear, "KERNEL_CONFIG", linear.KERNEL_CONFIG)
    got = linear_config("num_stages=3,block_n=32")
    assert got["num_stages"] == 3 and got["block_n"] == 32
    assert linear.KERNEL_CONFIG.num_stages == 3
    with pytest.raises(SystemExit, match="no field 'prefetch'"):
        linear_config("prefetch=1")


def test_the_round_table_splits_a_fixed_length_round_and_keeps_the_policy_row():
    from benchmarks.bench_runner import round_table

    rounds = {"4": dict(ms=6.0, mean_w=4.0), "hybridspec": dict(ms=7.0, mean_w=6.5)}
    compiled = {"4": dict(ms=5.5, mean_w=4.0), "hybridspec": dict(ms=6.4, mean_w=6.5)}
    split = {4: dict(drafter=0.8, stage0=0.1)}
    table = round_table(rounds, compiled, {4: 4.5}, split)
    assert table["4"]["rest_ms"] == pytest.approx(0.7) and table["4"]["stage0_compiled_ms"] is None
    assert table["4"]["round_compiled_front_ms"] == 5.5
    assert table["hybridspec"] == dict(round_ms=7.0, mean_w=6.5, round_compiled_front_ms=6.4)
