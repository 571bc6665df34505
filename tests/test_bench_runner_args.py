"""`benchmarks/bench_runner.py`'s pure helpers: `--inductor` applies the settings it names, parsed
to the setting's type, globally and in the runner's compile options (a name inductor does not have
stops the run before anything is built); `--linear`; the round table; the split's bytes bounds."""

from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config

from benchmarks.bench_runner import inductor_settings, linear_config, moe_config
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


def test_moe_config_sets_the_named_fields(monkeypatch):
    from hybridspec.ops import moe

    monkeypatch.setattr(moe, "KERNEL_CONFIG", moe.KERNEL_CONFIG)
    got = moe_config("combine_in_consumer=1,down_block_h=32")
    assert got["combine_in_consumer"] == 1 and moe.KERNEL_CONFIG.down_block_h == 32
    with pytest.raises(SystemExit, match="no field 'fused'"):
        moe_config("fused=1")


def test_the_round_table_splits_a_fixed_length_round_and_keeps_the_policy_row():
    from benchmarks.bench_runner import round_table

    rounds = {"4": dict(ms=6.0, mean_w=4.0), "hybridspec": dict(ms=7.0, mean_w=6.5)}
    compiled = {"4": dict(ms=5.5, mean_w=4.0), "hybridspec": dict(ms=6.4, mean_w=6.5)}
    split = {4: dict(drafter=0.8, stage0=0.1)}
    table = round_table(rounds, compiled, {4: 4.5}, split)
    assert table["4"]["rest_ms"] == pytest.approx(0.7) and table["4"]["stage0_compiled_ms"] is None
    assert table["4"]["round_compiled_front_ms"] == 5.5
    assert table["hybridspec"] == dict(round_ms=7.0, mean_w=6.5, round_compiled_front_ms=6.4)


def test_the_parts_bytes_add_up_to_the_verification_bound():
    from benchmarks.bench_runner import BOUND_PARTS, bytes_bound, component_bytes
    from hybridspec.tiny import tiny_drafter, tiny_target

    model, drafter = tiny_target(), tiny_drafter()
    cfg = model.config
    parts = component_bytes(model, drafter, distinct_pairs=37, context=0)
    total, _ = bytes_bound(model, 37, 16, 1000.0)
    assert sum(parts[k] for k in BOUND_PARTS if k != "drafter") + parts["other"] == total
    assert all(parts[k] > 0 for k in BOUND_PARTS)
    # one more distinct expert adds one expert's weights to the MoE part alone
    more = component_bytes(model, drafter, distinct_pairs=38, context=0)
    expert = model.model.layers[0].mlp.experts
    one = (expert.gate_up_proj[0].numel() + expert.down_proj[0].numel()) * expert.down_proj.element_size()
    assert more["moe"] - parts["moe"] == one and {k: v for k, v in more.items() if k != "moe"} == {
        k: v for k, v in parts.items() if k != "moe"}
    # the attention part reads each full-attention layer's cached keys and values
    attn = sum(t == "full_attention" for t in cfg.layer_types)
    at10 = component_bytes(model, drafter, distinct_pairs=37, context=10)
    kv = attn * 10 * cfg.num_key_value_heads * cfg.head_dim * 2 * model.lm_head.weight.element_size()
    assert at10["attention"] - parts["attention"] == kv
    # the drafter reads its own weights and the target's head
    assert parts["drafter"] == parts["lm_head_accept"] + sum(p.numel() * p.element_size() for p in drafter.parameters())
    # a batch of 3 reads the weights once and each sequence's GDN states and cached keys and values
    b3 = component_bytes(model, drafter, distinct_pairs=37, context=10, batch=3)
    gdn_weights = parts["gdn"] - (component_bytes(model, drafter, 37, 0, batch=2)["gdn"] - parts["gdn"])
    assert b3["gdn"] - gdn_weights == 3 * (parts["gdn"] - gdn_weights)
    assert b3["attention"] - parts["attention"] == 3 * kv
    assert {k: b3[k] for k in ("moe", "lm_head_accept", "drafter", "other")} == {
        k: parts[k] for k in ("moe", "lm_head_accept", "drafter", "other")}


def test_the_split_is_divided_by_each_parts_bound():
    from benchmarks.bench_runner import BOUND_PARTS, component_bytes, split_bounds
    from hybridspec.tiny import tiny_drafter, tiny_target

    model, drafter = tiny_target(), tiny_drafter()
    split = {1: dict.fromkeys(BOUND_PARTS, 2.0), 16: dict.fromkeys(BOUND_PARTS, 4.0)}
    bounds, rows = split_bounds(model, drafter, split, {1: 5, 16: 20}, context=8, bandwidth_gbs=1000.0)
    assert set(bounds) == {"1", "16"} and bounds["16"]["distinct_pairs"] == 20
    moe_ms = component_bytes(model, drafter, 20, 8)["moe"] / 1e12 * 1e3
    assert bounds["16"]["moe"] == moe_ms
    assert rows[1][:2] == [16, 20] and rows[1][2 + BOUND_PARTS.index("moe")] == 4.0 / moe_ms
    assert rows[0][2 + BOUND_PARTS.index("gdn")] == 2.0 / bounds["1"]["gdn"]


def test_config_variants_are_parsed_and_checked():
    from benchmarks.bench_runner import config_variants

    assert config_variants("out_split_k=4;router_split_k=8;out_split_k=2,router_split_k=2;", "linear") == [
        ("linear", {"out_split_k": 4}), ("linear", {"router_split_k": 8}),
        ("linear", {"out_split_k": 2, "router_split_k": 2})]
    assert config_variants("", "linear") == [] and config_variants("block_n=32") == [("linear", {"block_n": 32})]
    assert config_variants("gate_up_block_i=32;down_block_h=16,num_stages=2", "moe") == [
        ("moe", {"gate_up_block_i": 32}), ("moe", {"down_block_h": 16, "num_stages": 2})]
    assert config_variants("BV=64;num_warps=8", "gdn") == [("gdn", {"BV": 64}), ("gdn", {"num_warps": 8})]
    assert config_variants("fused=0", "attention") == [("attention", {"fused": 0})]
    for bad, kind, match in (("out_split_k=0", "linear", r"--ar-linear: out_split_k must be in 1..16, got 0"),
                             ("router_split_k=17", "linear", r"router_split_k must be in 1..16, got 17"),
                             ("in_split_k=x", "linear", "in_split_k must be an integer, got 'x'"),
                             ("out_split_k=2;nope=1", "linear", "LinearKernelConfig has no field 'nope'"),
                             ("out_split_k=2", "moe", "--ar-moe: MoEKernelConfig has no field 'out_split_k'"),
                             ("BV=64", "attention", "--ar-attention: PROLOGUE_CONFIG has no field 'BV'")):
        with pytest.raises(SystemExit, match=match):
            config_variants(bad, kind)


@pytest.mark.parametrize("batch", [1, 2])
def test_the_split_parts_run_at_each_batch_size(batch):
    """Every part `component_split` times runs on the CPU (tiny models, eager) for a batch of B
    rows, and the distinct (layer, expert) pairs are the union over the batch's rows: non-decreasing
    in w, at least one row's count and at most the batch's sum."""
    import torch

    from benchmarks.bench_runner import W, split_parts
    from hybridspec.ops.routing import distinct_prefix_counts
    from hybridspec.patches import family_of
    from hybridspec.patches.forward import verify_forward
    from hybridspec.tiny import tiny_drafter, tiny_target

    torch.manual_seed(0)
    model, drafter = tiny_target(), tiny_drafter()
    drafter.bind(model)
    prompt = torch.randint(0, model.config.get_text_config().vocab_size, (batch, 12),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        runner, parts, tokens, per_layer, num, distinct = split_parts(model, drafter, prompt, compile_layers=False)
        assert tokens.shape == (batch, W) and num.shape == (batch,)
        for name, fn in parts.items():
            assert per_layer[name] >= 1
            num.fill_(4)
            fn()
        # the union against each row's own count, from the same block
        routing = []
        verify_forward(family_of(model), model, tokens, runner.state, (), routing)
    ids = torch.stack(routing)  # [L, B, W, k]
    experts = family_of(model).text_config(model).num_experts
    rows = [distinct_prefix_counts(ids[:, b], experts).sum(0) for b in range(batch)]
    assert len(distinct) == W and all(a <= b for a, b in zip(distinct, distinct[1:]))
    for j in range(W):
        assert max(int(r[j]) for r in rows) <= distinct[j] <= sum(int(r[j]) for r in rows)
    if batch == 1:
        assert distinct == rows[0].tolist()


def test_print_split_lists_every_part_and_skips_unmeasured_kernels(capsys):
    from benchmarks.bench_runner import print_split

    split = {1: dict(gdn=1.5, moe=4.25), 4: dict(gdn=1.75, moe=8.5)}
    kernels = dict(gdn=dict(kernels_per_layer=9.0, top=[dict(us_per_layer=16.25, launches_per_layer=1.0, name="nvjet")]),
                   stage0_compiled=dict(error="RuntimeError: no"))
    print_split(split, kernels)
    out = capsys.readouterr().out
    assert "gdn: 9.0 kernels per layer" in out and "16.2 us  x1.0  nvjet" in out and "stage0_compiled" not in out
    assert "gdn ms" in out and "moe ms" in out and "8.5" in out


def test_split_variants_parse_each_kind_and_stop_on_bad_input():
    from benchmarks.bench_runner import split_variants

    got = split_variants("moe:down_block_h=32;linear:wide_block_n=32,min_programs=64;gdn:BV=64;")
    assert got == [("moe", {"down_block_h": 32}), ("linear", {"wide_block_n": 32, "min_programs": 64}),
                   ("gdn", {"BV": 64})]
    assert split_variants("") == []
    with pytest.raises(SystemExit, match="kind:name=value"):
        split_variants("down_block_h=32")
    with pytest.raises(SystemExit, match="kind:name=value"):
        split_variants("mamba:block_n=32")
    with pytest.raises(SystemExit, match="PROLOGUE_CONFIG has no field 'block_n'"):
        split_variants("attention:block_n=32")
    assert split_variants("attention:fused=0") == [("attention", {"fused": 0})]
    with pytest.raises(SystemExit, match="VERIFY_CONFIG has no field 'BQ'"):
        split_variants("gdn:BQ=64")
    with pytest.raises(SystemExit, match="MoEKernelConfig has no field 'fused'"):
        split_variants("moe:fused=1")


def test_a_config_variant_applies_inside_and_restores_after():
    from benchmarks.bench_runner import config_variant
    from hybridspec.ops import gdn, linear, moe

    before = (dict(gdn.VERIFY_CONFIG), linear.KERNEL_CONFIG, moe.KERNEL_CONFIG)
    with config_variant("gdn", {"BV": 64}):
        assert gdn.VERIFY_CONFIG["BV"] == 64 and gdn.VERIFY_CONFIG["BK"] == before[0]["BK"]
    with config_variant("linear", {"wide_block_n": 32}):
        assert linear.KERNEL_CONFIG.wide_block_n == 32
    with pytest.raises(RuntimeError), config_variant("moe", {"down_block_h": 32}):
        assert moe.KERNEL_CONFIG.down_block_h == 32
        raise RuntimeError("a failed measurement")
    assert (dict(gdn.VERIFY_CONFIG), linear.KERNEL_CONFIG, moe.KERNEL_CONFIG) == before


def test_split_at_parses_lengths_and_rejects_bad_ones():
    import argparse

    from benchmarks.bench_runner import widths_arg

    assert widths_arg("1,2,4,8,12,16") == (1, 2, 4, 8, 12, 16)
    for bad in ("", "1,x", "0,4", "4,17"):
        with pytest.raises(argparse.ArgumentTypeError):
            widths_arg(bad)


def test_gpu_state_rows_parse_to_numbers():
    """nvidia-smi's csv row (no header, no units) -> numbers by name; "[N/A]" -> None; the event
    reasons stay nvidia-smi's mask; a row of the wrong width raises instead of shifting the fields."""
    from benchmarks.common import GPU_STATE_FIELDS, parse_gpu_state

    assert parse_gpu_state("1980, 2619, 41, 512.37, 0x0000000000000004") == dict(
        sm_clock_mhz=1980.0, mem_clock_mhz=2619.0, temperature_c=41.0, power_w=512.37,
        clock_event_reasons="0x0000000000000004")
    assert parse_gpu_state("1755, 2619, 63, [N/A]", GPU_STATE_FIELDS[:-1]) == dict(
        sm_clock_mhz=1755.0, mem_clock_mhz=2619.0, temperature_c=63.0, power_w=None)
    with pytest.raises(ValueError, match="expected 5 values"):
        parse_gpu_state("1980, 2619, 41")


def test_gpu_states_summarize_the_lowest_clock_and_every_reason():
    from benchmarks.common import parse_gpu_state, summarize_gpu_states

    rows = [parse_gpu_state(line) for line in ("1980, 2619, 41, 500.0, 0x0000000000000000",
                                                "1755, 2619, 63, 690.5, 0x0000000000000004",
                                                "1980, 2619, 52, [N/A], 0x0000000000000000")]
    assert summarize_gpu_states(rows) == dict(
        samples=3, sm_clock_mhz_min=1755.0, sm_clock_mhz_median=1980.0, mem_clock_mhz_min=2619.0,
        temperature_c_max=63.0, power_w_max=690.5,
        clock_event_reasons=["0x0000000000000000", "0x0000000000000004"])


FAKE_SMI = """#!/usr/bin/env python3
import os, pathlib, sys, time
args = " ".join(sys.argv[1:])
if "clocks_event_reasons" in args and "{refuse}" == "yes":
    print('Field "clocks_event_reasons.active" is not a valid field to query.'); sys.exit(2)
row = "1980, 2619, 41, 500.0" + (", 0x0000000000000004" if "clocks_event_reasons" in args else "")
if "-lms" not in args:
    print(row); sys.exit(0)
printed = 0
while True:
    print(row, flush=True)
    printed += 1
    if printed == 3:  # tell the test that samples are out, however slowly this process started
        pathlib.Path(os.environ["FAKE_SMI_READY"]).touch()
    time.sleep(0.02)
"""


@pytest.mark.parametrize("refuse", ["no", "yes"])
def test_gpu_sampler_samples_while_the_block_runs(tmp_path, monkeypatch, refuse):
    """A stand-in nvidia-smi on PATH: the sampler runs it in a loop during the block and summarizes
    what it printed; a driver that refuses the clock-event reasons field is asked without it."""
    import time

    from benchmarks import common

    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI.replace("{refuse}", refuse))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(common, "_nvidia_smi_id", lambda: "GPU-test")
    ready = tmp_path / "ready"
    monkeypatch.setenv("FAKE_SMI_READY", str(ready))
    with common.GpuSampler(interval_ms=20) as gpu:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    assert gpu.summary["samples"] >= 3
    assert gpu.summary["sm_clock_mhz_min"] == 1980.0 and gpu.summary["power_w_max"] == 500.0
    assert gpu.summary["clock_event_reasons"] == ([] if refuse == "yes" else ["0x0000000000000004"])


def test_gpu_sampler_without_nvidia_smi_reports_an_error(tmp_path, monkeypatch):
    from benchmarks import common

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(common, "_nvidia_smi_id", lambda: "GPU-test")
    with common.GpuSampler() as gpu:
        pass
    assert set(gpu.summary) == {"error"}
