"""One MoE experts layer of the Qwen3.5-35B-A3B shape on one GPU (256 experts, H 2048, I 512, bf16).

Latency of `hybridspec.ops.moe_experts` (CUDA graph) and of transformers' `grouped_mm` and
`batched_mm` experts paths (CUDA graph where capture works, else eager; the output says which) at
16 rows x top-8 with exactly U distinct experts, and at 1 row (an AR step). The bytes bound is the
selected experts' bytes at the device-to-device copy bandwidth measured in this run (bytes read +
written). Every sample picks a fresh random set of experts and the L2 is flushed before it, so no
sample finds its weights in L2. Fit latency = a + eta * U per path; report eta and Pearson r. The
headline per case compares against the faster of the two transformers paths (`transformers_best`).

The read floor (benchmarks/read_floor.py) is one kernel that only reads the same U experts' bytes,
the fastest of a few chunkings, timed the same way: the most any MoE op could reach in this
protocol (one graph launch, cold L2, a few MB per expert).

The flush reads 256 MB (`--flush read`, the default): the L2 then holds clean lines, as it does in
a decode step, where the kernels before an MoE layer mostly read weights. `--flush write` writes
256 MB instead (the first runs' protocol): the timed op then also pays the write-back of the dirty
lines it evicts.

    python benchmarks/bench_moe.py [--out bench_out/moe.json] [--config gate_up_block_i=64,pdl=0,...]
    python benchmarks/bench_moe.py --sweep     # pdl/tile/warp/stage sweep, then the full run with the best

The table times the chosen config (`hybridspec`) and, next to it, the MoEKernelConfig defaults with
programmatic dependent launch off (`hybridspec_nopdl`). Every config is checked against the naive
twin before it is timed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import capture, copy_bandwidth_gbs, env_info, print_table, write_json  # noqa: E402
from hybridspec.ops import moe as moe_mod  # noqa: E402
from benchmarks.read_floor import CONFIGS as FLOOR_CONFIGS  # noqa: E402
from benchmarks.read_floor import read_experts  # noqa: E402
from hybridspec.ops import moe_experts, naive_moe  # noqa: E402

E, H, I, K = 256, 2048, 512, 8
U_LIST = (8, 16, 32, 64, 96, 128)
# transformers' experts implementations (`config._experts_implementation`; both in transformers 5.17 to 5.24)
TRANSFORMERS_IMPLS = ("batched_mm", "grouped_mm")
# cases whose error vs the naive twin the full run reports
CHECK_CASES = ((16, 64), (16, 8), (1, 8))
# gate, up and down of one expert in bf16: 6.29 MB
EXPERT_BYTES = 3 * H * I * 2


def routing(rows: int, U: int, gen: torch.Generator):
    """ids [rows, K] naming exactly U distinct experts (k distinct per row) and normalised weights."""
    chosen = torch.randperm(E, generator=gen)[:U]
    # row r takes K consecutive entries of the cycle over `chosen`: distinct as U >= K, all U used
    flat = torch.arange(rows * K) % U
    ids = chosen[flat].view(rows, K)
    w = torch.rand(rows, K, generator=gen)
    return ids.cuda(), (w / w.sum(-1, keepdim=True)).to(torch.bfloat16).cuda()


def timed(run, ids_buf, w_buf, samples, flush):
    """Median-ready latencies (us) of `run`, one per routing sample, `flush()` run before each."""
    # warm-up
    for ids, w in samples[:3]:
        ids_buf.copy_(ids)
        w_buf.copy_(w)
        run()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in samples]
    for (ids, w), (a, b) in zip(samples, ev):
        flush()
        ids_buf.copy_(ids)
        w_buf.copy_(w)
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in ev]


def transformers_experts(gate_up, down, impl):
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    # the defaults are the 35B-A3B shape
    config = Qwen3_5MoeTextConfig()
    assert (config.num_experts, config.hidden_size, config.moe_intermediate_size) == (E, H, I)
    config._experts_implementation = impl
    with torch.device("meta"):
        experts = Qwen3_5MoeExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return experts


class Bench:
    def __init__(self, samples_per_case: int, flush: str = "read"):
        gen = torch.Generator().manual_seed(0)
        self.gate_up = (torch.randn(E, 2 * I, H, device="cuda") * H**-0.5).to(torch.bfloat16)
        self.down = (torch.randn(E, H, I, device="cuda") * I**-0.5).to(torch.bfloat16)
        # read (or written) before every sample: over 4x the 60 MB L2
        self.flush_buffer = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")
        # a read leaves clean lines (nothing to write back), a write leaves dirty ones
        self.flush = self.flush_buffer.amax if flush == "read" else self.flush_buffer.zero_
        self.cases = [(16, U) for U in U_LIST] + [(1, K), (4, 32)]
        self.samples = {c: [routing(*c, gen) for _ in range(samples_per_case)] for c in self.cases}
        self.hidden = {rows: torch.randn(rows, H, generator=gen).to(torch.bfloat16).cuda() for rows in (1, 4, 16)}
        # bytes/s, read + written
        self.bw = copy_bandwidth_gbs() * 1e9
        # case -> the naive twin's output on the case's first sample
        self.refs = {}

    def bound_us(self, U):
        return U * EXPERT_BYTES / self.bw * 1e6

    def measure(self, case, make_fn, samples=None):
        rows, _ = case
        samples = samples or self.samples[case]
        ids_buf, w_buf = (x.clone() for x in samples[0])
        fn = make_fn(self.hidden[rows], ids_buf, w_buf)
        mode = "graph"
        try:
            run = capture(fn).replay
        # capture failed: time the eager path and say why
        except Exception as exc:
            torch.cuda.synchronize()
            mode, run = f"eager ({type(exc).__name__}: {str(exc).splitlines()[0][:70]})", fn
        return float(np.median(timed(run, ids_buf, w_buf, samples, self.flush))), mode

    def ours(self, hidden, ids, w):
        nt = torch.tensor([hidden.shape[0]], device="cuda")
        return lambda: moe_experts(hidden, ids, w, self.gate_up, self.down, num_tokens=nt)

    def read_floor(self, case) -> tuple[float, str]:
        """The fastest of FLOOR_CONFIGS at reading the case's U experts (and nothing else), timed as
        the op is. `routing` puts the U distinct experts first in the flat ids."""
        U = case[1]
        first = self.samples[case][0][0].view(-1)[:U]
        ref = self.gate_up[first].float().sum() + self.down[first].float().sum()
        best = (float("inf"), "")
        for cfg in FLOOR_CONFIGS:
            def make(x, ids, w, cfg=cfg):
                return lambda: read_experts(self.gate_up, self.down, ids.view(-1)[:U], cfg)
            # the chunk sums add up to the selected experts' sum: the floor reads what it claims
            got = read_experts(self.gate_up, self.down, first, cfg).sum()
            if not torch.allclose(got, ref, rtol=1e-3, atol=1e-1):
                raise AssertionError(f"read floor {cfg}: sum {got.item()} != {ref.item()}")
            t, mode = self.measure(case, make)
            if mode != "graph":
                raise RuntimeError(f"read floor not captured: {mode}")
            best = min(best, (t, f"chunk={cfg[0]},block={cfg[1]},warps={cfg[2]}"))
        return best

    def check(self, cfg: dict, cases=CHECK_CASES, vs_transformers: bool = False) -> dict:
        """Relative error of the op under `cfg` vs the naive twin on each case's first sample (an
        AssertionError past 1e-2; the first call also compiles) and, informational, vs transformers'
        grouped_mm."""
        errs = {}
        for case in cases:
            ids, w = self.samples[case][0]
            x = self.hidden[case[0]]
            with use_config(cfg):
                out = moe_experts(x, ids, w, self.gate_up, self.down).float()
            if case not in self.refs:
                self.refs[case] = naive_moe.moe_experts(x, ids, w, self.gate_up, self.down).float()
            ref = self.refs[case]
            key = f"{case[0]}x{case[1]}"
            errs[key] = {"vs_naive": ((out - ref).norm() / ref.norm()).item()}
            if not errs[key]["vs_naive"] < 1e-2:
                raise AssertionError(f"rel err {errs[key]['vs_naive']:.2e} vs naive at {key}")
            if not vs_transformers:
                continue
            # informational: transformers rounds gate and up to bf16 separately
            try:
                tf = transformers_experts(self.gate_up, self.down, "grouped_mm")(x, ids, w).float()
                errs[key]["vs_grouped_mm"] = ((out - tf).norm() / tf.norm()).item()
            except Exception as exc:
                errs[key]["vs_grouped_mm"] = f"{type(exc).__name__}: {exc}"[:120]
        return errs


def fit(us, lat):
    eta, a = np.polyfit(us, lat, 1)
    return {"a_us": float(a), "eta_us_per_expert": float(eta), "pearson_r": float(np.corrcoef(us, lat)[0, 1])}


_BOOLS = {"0": False, "1": True, "false": False, "true": True, "off": False, "on": True}


def parse_config(text: str) -> dict:
    """`k=v,k=v` into MoEKernelConfig overrides, each value of its field's type (bools: 0/1, on/off)."""
    defaults = dataclasses.asdict(moe_mod.MoEKernelConfig())
    out = {}
    for kv in filter(None, text.split(",")):
        k, _, v = kv.partition("=")
        if k not in defaults:
            raise SystemExit(f"unknown MoEKernelConfig field {k!r}; fields: {list(defaults)}")
        if isinstance(defaults[k], bool):
            if v.lower() not in _BOOLS:
                raise SystemExit(f"{k} takes one of {list(_BOOLS)}, got {v!r}")
            out[k] = _BOOLS[v.lower()]
        else:
            out[k] = type(defaults[k])(v)
    return out


def config_arg(cfg: dict) -> str:
    """`--config` value for `cfg`: the fields that differ from MoEKernelConfig's defaults."""
    defaults = dataclasses.asdict(moe_mod.MoEKernelConfig())
    return ",".join(f"{k}={int(v)}" for k, v in cfg.items() if defaults[k] != v) or "(defaults)"


@contextlib.contextmanager
def use_config(cfg: dict):
    """KERNEL_CONFIG is `cfg` inside the block (the op reads it at every call, so around capture)."""
    saved = moe_mod.KERNEL_CONFIG
    moe_mod.KERNEL_CONFIG = moe_mod.MoEKernelConfig(**cfg)
    try:
        yield
    finally:
        moe_mod.KERNEL_CONFIG = saved


def with_config(cfg: dict, make_fn):
    """`make_fn` whose calls (warm-up and capture) run under `cfg`."""
    def make(x, ids, w):
        fn = make_fn(x, ids, w)

        def run():
            with use_config(cfg):
                return fn()
        return run
    return make


def grid(**axes) -> list[dict]:
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


# Greedy phases, each on top of the best config so far: pdl on the defaults first (the previous
# defaults without it are the table's `hybridspec_nopdl`), then the tiles, and pdl again at the
# best tiles. About 70 configs at 1-10 s each (compile, check, capture, 20 samples per case) on an
# H200; --sweep-budget bounds it.
SWEEP_CASES = ((16, 8), (16, 32), (16, 128), (1, 8))
# (name, configs)
SWEEP_PHASES = [
    ("pdl", grid(pdl=(False, True))),
    ("gate/up", grid(gate_up_block_i=(32, 64, 128), gate_up_block_h=(128, 256, 512), gate_up_warps=(2, 4, 8))),
    ("down", grid(down_block_h=(32, 64, 128), down_block_i=(64, 128, 256), down_warps=(2, 4, 8))),
    ("stages", grid(num_stages=(2, 3, 4))),
    ("reduce", grid(reduce_block_h=(256, 1024, 2048))),
    ("pdl at the best tiles", grid(pdl=(False, True))),
]


def sweep(bench: Bench, samples: int, budget_s: float):
    """Greedy sweep of SWEEP_PHASES from the current config. Score: the worst latency / bytes-bound
    ratio over SWEEP_CASES (a phase with cases of its own is scored on those, then its best on all).

    Each config first runs eagerly on one sample per case and must match the naive twin (this also
    compiles it); a config that fails to compile (e.g. out of shared memory), to match, or to capture
    into a CUDA graph is reported and skipped. No config starts after `budget_s` seconds (the ones
    left are counted and reported), so the sweep's time stays bounded."""
    t0 = time.time()
    cases = [c for c in SWEEP_CASES if c in bench.samples]
    results = []
    # phase -> configs not run (budget spent)
    not_run = {}
    best_score, best = float("inf"), dataclasses.asdict(moe_mod.KERNEL_CONFIG)
    scores = {}

    def score_of(cfg: dict) -> float | None:
        try:
            bench.check(cfg, cases)
            lat = []
            for c in cases:
                t, mode = bench.measure(c, with_config(cfg, bench.ours), samples=bench.samples[c][:samples])
                if mode != "graph":
                    raise RuntimeError(f"not captured: {mode}")
                lat.append(t)
        # compile (out of resources), wrong result or capture failure: report and go on
        except Exception as exc:
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
            print(f"  failed  {config_arg(cfg)}  ({msg})")
            results.append({"config": cfg, "failed": msg})
            torch.cuda.synchronize()
            return None
        score = max(t / bench.bound_us(c[1]) for t, c in zip(lat, cases))
        results.append({"config": cfg, "latency_us": dict(zip(map(str, cases), lat)), "score": score,
                        "scored_on": [str(c) for c in cases]})
        print(f"  score {score:5.2f}  " + " ".join(f"{t:7.1f}" for t in lat) + f"  {config_arg(cfg)}")
        return score

    def scored(name, todo):
        """(config, score) for `todo` in order, until the budget is spent (the rest counted in
        `not_run`)."""
        out = []
        for i, cfg in enumerate(todo):
            if time.time() - t0 > budget_s:
                not_run[name] = len(todo) - i
                print(f"  budget of {budget_s:.0f} s spent: {len(todo) - i} configs of this phase not run")
                break
            out.append((cfg, score_of(cfg)))
        return out

    print(f"sweep cases (rows, U): {cases}; score = max latency / bytes bound; latencies in us")
    for name, overrides in SWEEP_PHASES:
        # a config run in an earlier phase keeps its score
        todo = [cfg for cfg in ({**best, **o} for o in overrides) if tuple(cfg.items()) not in scores]
        print(f"phase {name}: {len(todo)} configs, from {time.time() - t0:.0f} s")
        for cfg, score in scored(name, todo):
            scores[tuple(cfg.items())] = score
            if score is not None and score < best_score:
                best_score, best = score, cfg
    print(f"sweep took {time.time() - t0:.0f} s ({len(results)} configs)")
    if best_score == float("inf"):
        print("sweep: no config ran; keeping the current one")
        return {"cases": [str(c) for c in cases], "results": results, "best": None, "not_run": not_run}
    for k, v in best.items():
        setattr(moe_mod.KERNEL_CONFIG, k, v)
    print(f"best config (score {best_score:.2f}): --config {config_arg(best)}")
    return {
        "cases": [str(c) for c in cases],
        "results": results,
        "best": best,
        "best_score": best_score,
        "not_run": not_run,
        "seconds": time.time() - t0,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out/moe.json")
    p.add_argument("--samples", type=int, default=40, help="routing samples per case (median of them)")
    p.add_argument("--config", default="", help="kernel config overrides, e.g. gate_up_block_i=64,pdl=0")
    p.add_argument("--sweep", action="store_true", help="sweep pdl/tiles/warps/stages first, then run with the best")
    p.add_argument("--sweep-budget", type=float, default=80.0,
                   help="seconds after which the sweep starts no new config (the full run follows)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--flush", choices=("read", "write"), default="read",
                   help="how the L2 is flushed before each sample: read 256 MB (clean lines) or write it (dirty)")
    args = p.parse_args()
    t0 = time.time()
    for k, v in parse_config(args.config).items():
        setattr(moe_mod.KERNEL_CONFIG, k, v)
    bench = Bench(max(args.samples, 30), args.flush)
    report = {"env": env_info(), "copy_bw_TBps": bench.bw / 1e12, "flush": args.flush}
    env = report["env"]
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  transformers {env['transformers']}  "
          f"copy bandwidth {bench.bw / 1e12:.2f} TB/s (read+write)")
    if args.sweep:
        report["sweep"] = sweep(bench, samples=20, budget_s=args.sweep_budget)
    report["config"] = dataclasses.asdict(moe_mod.KERNEL_CONFIG)
    print(f"config: --config {config_arg(report['config'])}")
    nopdl = dataclasses.asdict(moe_mod.MoEKernelConfig(pdl=False))
    report["correctness"] = bench.check(report["config"], vs_transformers=True)
    report["correctness_nopdl"] = bench.check(nopdl)
    print("correctness (rel err):", json.dumps(report["correctness"]))

    paths = {
        "hybridspec": with_config(report["config"], bench.ours),
        "hybridspec_nopdl": with_config(nopdl, bench.ours),
    }
    if not args.skip_transformers:
        for impl in TRANSFORMERS_IMPLS:
            experts = transformers_experts(bench.gate_up, bench.down, impl)
            paths[impl] = lambda x, ids, w, m=experts: (lambda: m(x, ids, w))
    rows = []
    for case in bench.cases:
        row = {"rows": case[0], "U": case[1], "bound_us": bench.bound_us(case[1])}
        for name, make_fn in paths.items():
            row[f"{name}_us"], row[f"{name}_mode"] = bench.measure(case, make_fn)
        row["ratio"] = row["hybridspec_us"] / row["bound_us"]
        row["read_floor_us"], row["read_floor_config"] = bench.read_floor(case)
        row["ratio_to_floor"] = row["hybridspec_us"] / row["read_floor_us"]
        if TRANSFORMERS_IMPLS[0] in paths:
            # the headline baseline: the faster of transformers' experts paths on this case
            best = min(TRANSFORMERS_IMPLS, key=lambda n: row[f"{n}_us"])
            row["transformers_best"], row["transformers_best_us"] = best, row[f"{best}_us"]
            row["speedup_vs_transformers_best"] = row["transformers_best_us"] / row["hybridspec_us"]
        rows.append(row)
    report["cases"] = rows

    names = list(paths)
    print()
    print_table(["rows", "U", "bound us", "read floor us"] + [f"{n} us" for n in names] + ["ours/bound", "ours/floor"],
                [[r["rows"], r["U"], r["bound_us"], r["read_floor_us"]] + [r[f"{n}_us"] for n in names]
                 + [r["ratio"], r["ratio_to_floor"]] for r in rows])
    if "transformers_best" in rows[0]:
        print("vs the faster of transformers' experts paths (" + " / ".join(TRANSFORMERS_IMPLS) + "), per case:")
        print_table(["rows", "U", "faster transformers path", "its us", "hybridspec us", "speedup"],
                    [[r["rows"], r["U"], r["transformers_best"], r["transformers_best_us"], r["hybridspec_us"],
                      r["speedup_vs_transformers_best"]] for r in rows])
    print("read floor configs:", {f"{r['rows']}x{r['U']}": r["read_floor_config"] for r in rows})
    for n in names:
        print(f"{n}: {sorted({r[n + '_mode'] for r in rows})}")
    sixteen = [r for r in rows if r["rows"] == 16]
    us = np.array([r["U"] for r in sixteen], dtype=float)
    report["fit_16_rows"] = {n: fit(us, np.array([r[n + "_us"] for r in sixteen])) for n in names}
    for n, f in report["fit_16_rows"].items():
        print(f"fit {n:>16}: latency = {f['a_us']:.1f} us + {f['eta_us_per_expert']:.3f} us/expert * U, r = {f['pearson_r']:.4f}")
    one = next(r for r in rows if r["rows"] == 1)
    if "transformers_best" in one:
        report["headline_vs_transformers_best"] = {
            f"{r['rows']}x{r['U']}": {"baseline": r["transformers_best"], "speedup": r["speedup_vs_transformers_best"]}
            for r in rows}
    report["targets"] = {
        "max_ratio_16_rows (<= 1.5)": max(r["ratio"] for r in sixteen),
        "pearson_r (>= 0.99)": report["fit_16_rows"]["hybridspec"]["pearson_r"],
        "one_row_ratio_to_8_experts (<= 1.5)": one["ratio"],
    }
    print("targets:", json.dumps(report["targets"]))
    write_json(args.out, report)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
