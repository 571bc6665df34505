"""Length dispatch of a verification: the fixed 16-row CUDA graph against per-length `torch.cond`.

Qwen3.6-35B-A3B layer shapes (random bf16 weights on the GPU) at reduced depth, `--layers 4` by
default (one 3 GDN : 1 attention group): tracing the 16 `torch.cond` branches costs time per layer
and per branch, so the whole 40-layer stack would not trace within one device call. Per-layer work
is the same as in the full model. After a `--prompt`-token prefill, for w = 1..16, the latency of
verifying w draft rows (the whole stack, LM head and argmax excluded), side by side:

- `fixed_graph_compiled`: the runner's form. One CUDA graph of 16 rows whose kernels skip rows
  past the device-resident w; decoder layers compiled with `torch.compile` before capture.
- `fixed_graph`: the same graph with uncompiled layers.
- `exact_graphs`: 16 graphs with uncompiled layers, each captured at exactly w rows. What a
  dispatch among captured per-length graphs on the device (a CUDA SWITCH conditional node) would
  pay, less the cost of the node itself; compare it with `fixed_graph`.
- `cond`: `hybridspec.round.cond.CondVerify`, traced by dynamo and run as traced (what
  `torch.cond` does when called eagerly): each of the 4 tree levels reads its predicate on the host,
  and every kernel is its own launch. No CUDA graph can hold it on torch 2.11.
- `fixed_eager`: the 16-row form launched without a graph: the launch cost on its own.

    python benchmarks/bench_dispatch.py [--out bench_out/dispatch] [--layers 4] [--prompt 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hybridspec  # noqa: E402
from benchmarks.common import capture, env_info, print_table, time_ms, write_json  # noqa: E402
from hybridspec.round.prefill import prefill  # noqa: E402
from hybridspec.patches import family_of  # noqa: E402
from hybridspec.cache import compiled_once  # noqa: E402
from hybridspec.ops.dispatch import layer_options  # noqa: E402
from hybridspec.patches.forward import EAGER, Blocks, empty_state, load_prefill, verify_forward  # noqa: E402
from hybridspec.round.cond import CondVerify  # noqa: E402
from hybridspec.shapes import build_target  # noqa: E402
from hybridspec.state import MAX_VERIFY  # noqa: E402

W = MAX_VERIFY


def timed(label: str, run, replays: int = 5, samples: int = 10) -> float:
    ms = time_ms(run, replays=replays, samples=samples)
    print(f"  {label}: {ms:.3f} ms")
    return ms


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out/dispatch")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    args = parser.parse_args()
    info = env_info()
    print(info)
    model = build_target("qwen3.6-35b-a3b", num_layers=args.layers)
    hybridspec.enable(model)
    family = family_of(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    _, cache, _ = prefill(model, prompt, ())
    state = empty_state(family, model, 1, args.prompt + 2 * W, "cuda")
    load_prefill(state, cache)
    del cache
    tokens = torch.randint(0, model.config.vocab_size, (1, W), generator=torch.Generator().manual_seed(1)).cuda()
    num = torch.full((1,), W, dtype=torch.long, device="cuda")
    result = dict(env=info, layers=args.layers, prompt=args.prompt, rows={})

    def fixed(blocks):
        def run():
            state.num_tokens = num
            verify_forward(family, model, tokens, state, blocks=blocks)
        return run

    def exact(w):
        def run():
            state.num_tokens = None
            verify_forward(family, model, tokens[:, :w], state, blocks=EAGER)
        return run

    t0 = time.perf_counter()
    graphs = {"fixed_graph_compiled": capture(fixed(compiled_once(Blocks, layer_options()))), "fixed_graph": capture(fixed(EAGER))}
    exact_graphs = {w: capture(exact(w)) for w in range(1, W + 1)}
    result["capture_s"] = time.perf_counter() - t0
    conds = {}
    t0 = time.perf_counter()
    conds["cond"] = CondVerify(family, model, state, (), W, after_stage0=False)
    conds["cond"](num, tokens)
    result["cond_trace_s"] = time.perf_counter() - t0
    print(f"traced the 16 cond branches ({args.layers} layers) in {result['cond_trace_s']:.0f} s")

    for w in range(1, W + 1):
        num.fill_(w)
        print(f"w = {w}")
        row = {name: timed(name, g.replay) for name, g in graphs.items()}
        row["exact_graphs"] = timed("exact_graphs", exact_graphs[w].replay)
        for name, cond in conds.items():
            row[name] = timed(name, lambda: cond(num, tokens), replays=2, samples=5)
        row["fixed_eager"] = timed("fixed_eager", fixed(EAGER), replays=2, samples=5)
        result["rows"][w] = row
    # the cond branches and the fixed graph verify the same rows: the same hidden states
    num.fill_(5)
    state.num_tokens = num
    hidden_fixed, _ = verify_forward(family, model, tokens, state, blocks=EAGER)
    hidden_cond, _ = conds["cond"](num, tokens)
    result["max_abs_diff_w5"] = float((hidden_fixed[:, :5].float() - hidden_cond[:, :5].float()).abs().max())

    names = list(result["rows"][1])
    print_table(["w", *names], [[w, *(r[n] for n in names)] for w, r in result["rows"].items()])
    mean = {n: sum(r[n] for r in result["rows"].values()) / W for n in names}
    result["mean_ms"] = mean
    print("mean over w: " + ", ".join(f"{n} {v:.3f}" for n, v in mean.items()))
    print(f"cond / fixed_graph_compiled = {mean['cond'] / mean['fixed_graph_compiled']:.2f}x; exact_graphs / fixed_graph = "
          f"{mean['exact_graphs'] / mean['fixed_graph']:.2f}x; max |hidden diff| at w = 5: {result['max_abs_diff_w5']:.3g}")
    write_json(Path(args.out) / "dispatch.json", result)


if __name__ == "__main__":
    main()
