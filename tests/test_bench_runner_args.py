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
