"""The MoE block's first GEMM and router tail as one launch (`hybridspec.ops.router_topk`, issue 16)
against the two launches the block ran before it (`small_linear`, then `route_topk` on the router's
columns), bf16, H = 2048, T = 1, 4, 8, 16 rows, for the 35B-A3B / 122B-A10B block (E = 256 top-8,
272 fused rows: router, shared expert's gate, padding) and Qwen3-Next's router (E = 512 top-10, 528
rows). Each case first checks that the fused op gives the pair's bits (logits, weights, ids).

Timed chained: one call per distinct cold weight (and its own counter, as each layer holds one),
back to back in one CUDA graph, as a decode step runs its 40 layers; us per call, median.

    python benchmarks/bench_router.py [--out bench_out/router.json] [--samples 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import capture, env_info, print_table, time_ms, write_json  # noqa: E402
from hybridspec.ops import route_topk, router_topk, small_linear  # noqa: E402
from hybridspec.ops.router import new_counter  # noqa: E402

H = 2048
# (experts, fused rows, top-k)
SHAPES = [(256, 272, 8), (512, 528, 10)]
ROWS = (1, 4, 8, 16)
# distinct weights per chain: the decode step's MoE layers
LAYERS = 40
DTYPE = torch.bfloat16


def pair(x, w, E, k):
    logits = small_linear(x, w)
    weights, ids = route_topk(logits[:, :E], k)
    return logits, weights, ids


def case(T: int, E: int, N: int, k: int, samples: int, gen: torch.Generator) -> dict:
    x = torch.randn(T, H, device="cuda", generator=gen).to(DTYPE)
    weights = [(torch.randn(N, H, device="cuda", generator=gen) * H**-0.5 * 3).to(DTYPE) for _ in range(LAYERS)]
    counters = [new_counter("cuda") for _ in weights]
    fused, ref = router_topk(x, weights[0], E, k, counters[0]), pair(x, weights[0], E, k)
    same = all(torch.equal(a, b) for a, b in zip(fused, ref))
    if not same:
        raise AssertionError(f"router_topk at T={T}, E={E}, N={N}: not small_linear + route_topk's bits")
    row = {"T": T, "E": E, "N": N, "k": k, "bitwise_equal": same}
    for name, fn in [("fused", lambda w, c: router_topk(x, w, E, k, c)), ("pair", lambda w, c: pair(x, w, E, k))]:
        graph = capture(lambda: [fn(w, c) for w, c in zip(weights, counters)])
        row[f"{name}_us"] = time_ms(graph.replay, replays=3, samples=samples) * 1e3 / LAYERS
    if any(int(c.item()) for c in counters):
        raise AssertionError("a counter was left non-zero")
    row["saved_us"] = row["pair_us"] - row["fused_us"]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out/router.json")
    p.add_argument("--samples", type=int, default=30, help="samples per case (median of them)")
    args = p.parse_args()
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    # kernel timings on random inputs: no drafter, so no acceptance, simulated or real
    report = {"env": env_info(), "samples": args.samples, "layers": LAYERS,
              "acceptance": "not applicable (kernel timings, no speculative decoding)"}
    env = report["env"]
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}")
    rows = [case(T, E, N, k, args.samples, gen) for E, N, k in SHAPES for T in ROWS]
    report["cases"] = rows
    print(f"\nMoE block's GEMM + router tail, bf16, H = {H}: us per layer, {LAYERS} layers chained in one graph")
    print_table(["T", "E", "N", "k", "small_linear + route_topk", "router_topk", "saved", "bitwise equal"],
                [[r["T"], r["E"], r["N"], r["k"], r["pair_us"], r["fused_us"], r["saved_us"], r["bitwise_equal"]]
                 for r in rows])
    write_json(args.out, report)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
