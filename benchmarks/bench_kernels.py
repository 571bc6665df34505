"""The two kernels of issue 16 against the paths they replace, at the Qwen3.6-35B-A3B shape (bf16).

1. Decode attention of one attention layer (16 query / 2 key heads, head dim 256, output gate):
   `hybridspec.ops.decode_attention` (split over the context, reads positions < L + W) against the
   path `patches/common.py` ran before it: transformers' `sdpa_attention_forward` over the whole
   KV buffer under a boolean mask (which makes transformers repeat the keys and values for every
   query head), then the sigmoid gate. Context L = 512 and 8,192, W = 1, 4, 16; the buffer holds
   L + `--new` + 64 positions, as a runner sized for the request would. The bytes bound is the keys
   and values below L + W at the device-to-device copy bandwidth measured in this run.
2. The drafter's LM head (vocabulary 248,320, hidden 2048) for N = B x 15 rows (B = 1, 4):
   `hybridspec.ops.lm_head_top1` against the eager path (`F.linear`, argmax, fp32 softmax, gather,
   entropy). Bound: the weight's bytes at the copy bandwidth.
3. The MoE router's tail on bf16 router logits `[R, E]` (R = 1, 16, 64 rows; E = 256 experts top-8,
   the 35B-A3B and 122B-A10B routers, and E = 512 top-10, Qwen3-Next's): `hybridspec.ops.route_topk`
   against the path `patches.common.route_logits` runs (fp32 softmax, `torch.topk`, renormalise,
   cast), eager and compiled with `torch.compile` as the runner compiles it. No bytes bound (a few KB).
4. Few-row linear `x [M, K] @ W.T`, M = 1, 16, 64, bf16: `hybridspec.ops.small_linear` (one program
   per block_n output features) against `F.linear` (cuBLAS, whose grid at these shapes has ~20-30
   CTAs) and `F.linear` compiled with `torch.compile`, for (N, K) = (1296, 2048), the 35B-A3B
   MoE block's fused weight with the shared expert's gate/up (the path where the experts op does
   not run the shared expert); (272, 2048), router + shared gate padded, the block's GEMM where the
   experts op runs the shared expert; (256, 2048), the
   router's rows alone; (2048, 512), the shared expert's down projection; (2048, 4096), the
   attention o_proj / GDN out_proj. Checked against `F.linear` (relative error, norm-wise and of the
   largest element, below 1e-2). Bound: the weight's bytes at the copy bandwidth.

Every path is captured in a CUDA graph and checked against the naive twin first; each sample is
one replay after a 256 MB read that flushes the L2; the table gives medians in us.

    python benchmarks/bench_kernels.py [--out bench_out/kernels.json] [--samples 50] [--sweep]
        [--only attention lm_head router linear]

`--sweep` first times a few tile/split configurations of each kernel and runs the table with the
best (the score: the worst ratio to the bytes bound over the cases); for the few-row linear it tries
block_n 16/32/64, block_k 128/256 and 3/4 stages, scored by the sum of its times
(timed chained: distinct cold weights back to back in one graph, as a decode step runs them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import capture, copy_bandwidth_gbs, env_info, print_table, time_ms, write_json  # noqa: E402
from hybridspec.ops import attention as attn_mod  # noqa: E402
from hybridspec.ops import linear as linear_mod  # noqa: E402
from hybridspec.ops import lm_head as head_mod  # noqa: E402
from hybridspec.ops import (  # noqa: E402
    decode_attention, lm_head_top1, naive_attention, naive_lm_head, route_topk, small_linear)

HQ, HKV, D = 16, 2, 256
VOCAB, HIDDEN = 248_320, 2048
CONTEXTS = (512, 8192)
WIDTHS = (1, 4, 16)
ROWS = (1, 15, 16, 60)
# (rows, experts, top-k) of the router cases
ROUTER_CASES = [(r, 256, 8) for r in (1, 16, 64)] + [(r, 512, 10) for r in (1, 16, 64)]
# (N, K) of the few-row linear cases, and their rows
LINEAR_SHAPES = [(1296, 2048), (272, 2048), (256, 2048), (2048, 512), (2048, 4096)]
LINEAR_ROWS = (1, 16, 64)
DTYPE = torch.bfloat16

ATTENTION_SWEEP = [
    dict(),
    dict(programs_per_sm=2),
    dict(block_m=128, num_warps_large=8),
    dict(block_m=32),
    dict(block_n_large=64),
    dict(block_n_large=16),
    dict(num_warps_large=4),
    dict(num_stages=3),
    dict(max_splits=32),
    dict(max_splits=128, programs_per_sm=2),
]
HEAD_SWEEP = [
    dict(),
    dict(block_v=64),
    dict(block_v=256),
    dict(block_k=64),
    dict(block_k=256),
    dict(num_warps=8),
    dict(num_stages=4),
    dict(num_stages=2),
    dict(block_v=64, block_k=256, num_stages=4),
]

LINEAR_SWEEP = [dict(block_n=bn, block_k=bk, num_stages=stages)
                for bn in (16, 32, 64) for bk in (128, 256) for stages in (3, 4)]
# the chained timing of the few-row linear reads this many bytes of distinct weights per replay
CHAIN_BYTES = 256 << 20


@contextlib.contextmanager
def use_config(module, cfg: dict):
    """`module.KERNEL_CONFIG` with `cfg`'s overrides inside the block (the ops read it at every call)."""
    saved = module.KERNEL_CONFIG
    module.KERNEL_CONFIG = dataclasses.replace(saved, **cfg)
    try:
        yield
    finally:
        module.KERNEL_CONFIG = saved


def masked_sdpa(q, keys, values, start, scale, gate):
    """The attention `patches/common.py` ran before decode_attention: SDPA over the whole buffer
    under a mask built from the device length, then the gate (transformers' sdpa interface)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, W, Hq, Dh = q.shape
    module = types.SimpleNamespace(num_key_value_groups=Hq // keys.shape[1], is_causal=True, training=False)
    rows = start + torch.arange(W, device=q.device)
    allowed = torch.arange(keys.shape[2], device=q.device)[None, :] <= rows[:, None]
    mask = allowed[None, None].expand(B, 1, W, keys.shape[2])
    out, _ = sdpa_attention_forward(module, q.transpose(1, 2), keys, values, mask, dropout=0.0, scaling=scale)
    return out.reshape(B, W, -1) * torch.sigmoid(gate.reshape(B, W, -1))


class Bench:
    def __init__(self, samples: int, new: int):
        self.samples = samples
        self.new = new
        # read before every sample: over 4x the H200's L2, leaving clean lines
        self.flush_buffer = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")
        # bytes/s, read + written
        self.bw = copy_bandwidth_gbs() * 1e9
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5).to(DTYPE)
        self.gen = gen

    def timed(self, fn) -> tuple[float, str]:
        """Median latency (us) of `fn` captured in a CUDA graph, one replay per sample after an L2 flush."""
        try:
            run = capture(fn).replay
            mode = "graph"
        # capture failed: time the eager path and say why
        except Exception as exc:
            torch.cuda.synchronize()
            run, mode = fn, f"eager ({type(exc).__name__}: {str(exc).splitlines()[0][:70]})"
        for _ in range(3):
            run()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.samples)]
        for a, b in events:
            self.flush_buffer.amax()
            a.record()
            run()
            b.record()
        torch.cuda.synchronize()
        return float(np.median([a.elapsed_time(b) * 1e3 for a, b in events])), mode

    def chained(self, fn, weights: list) -> tuple[float, str]:
        """us per call of `fn(w)` over `weights` back to back in one CUDA graph: weights that never
        sit in the L2 and launches one after another, as a decode step's layers run them."""
        try:
            graph = capture(lambda: [fn(w) for w in weights])
        except Exception as exc:
            torch.cuda.synchronize()
            return float("nan"), f"failed ({type(exc).__name__}: {str(exc).splitlines()[0][:70]})"
        return time_ms(graph.replay, replays=3, samples=max(5, self.samples // 3)) * 1e3 / len(weights), "graph chain"

    def attention_inputs(self, L: int, W: int):
        S = L + self.new + 64
        g = self.gen
        q = torch.randn(1, W, HQ, D, device="cuda", generator=g).to(DTYPE)
        keys = torch.randn(1, HKV, S, D, device="cuda", generator=g).to(DTYPE)
        values = torch.randn(1, HKV, S, D, device="cuda", generator=g).to(DTYPE)
        gate = torch.randn(1, W, HQ, D, device="cuda", generator=g).to(DTYPE)
        return q, keys, values, torch.tensor([L], device="cuda"), gate

    def attention_bound_us(self, L: int, W: int) -> float:
        return 2 * HKV * (L + W) * D * 2 / self.bw * 1e6

    def attention_case(self, L: int, W: int, baseline: bool = True) -> dict:
        q, keys, values, lengths, gate = self.attention_inputs(L, W)
        scale = D**-0.5
        ours = decode_attention(q, keys, values, lengths, scale=scale, gate=gate)
        ref = naive_attention.decode_attention(q, keys, values, lengths, scale, gate).float()
        row = {"L": L, "W": W, "S": keys.shape[2], "bound_us": self.attention_bound_us(L, W),
               "rel_err_vs_naive": ((ours.float() - ref).norm() / ref.norm()).item()}
        if not row["rel_err_vs_naive"] < 1e-2:
            raise AssertionError(f"decode_attention at L={L}, W={W}: rel err {row['rel_err_vs_naive']:.2e} vs naive")
        row["ours_us"], row["ours_mode"] = self.timed(
            lambda: decode_attention(q, keys, values, lengths, scale=scale, gate=gate))
        if baseline:
            old = masked_sdpa(q, keys, values, lengths, scale, gate).float()
            row["sdpa_rel_err_vs_naive"] = ((old - ref.reshape(old.shape)).norm() / ref.norm()).item()
            row["sdpa_masked_us"], row["sdpa_masked_mode"] = self.timed(
                lambda: masked_sdpa(q, keys, values, lengths, scale, gate))
            row["speedup"] = row["sdpa_masked_us"] / row["ours_us"]
        row["ours_over_bound"] = row["ours_us"] / row["bound_us"]
        return row

    def head_bound_us(self) -> float:
        return VOCAB * HIDDEN * 2 / self.bw * 1e6

    def head_case(self, N: int, baseline: bool = True) -> dict:
        hidden = torch.randn(N, HIDDEN, device="cuda", generator=self.gen).to(DTYPE) * 2
        w = self.weight
        tokens, conf, ent = lm_head_top1(hidden, w)
        ref_tokens, ref_conf, ref_ent = naive_lm_head.lm_head_top1(hidden, w)
        row = {"N": N, "bound_us": self.head_bound_us(),
               "tokens_equal": int((tokens == ref_tokens).sum()), "of": N,
               "confidence_rel_err": ((conf - ref_conf).norm() / ref_conf.norm()).item(),
               "entropy_rel_err": ((ent - ref_ent).norm() / ref_ent.norm()).item()}
        if row["confidence_rel_err"] > 1e-2 or row["entropy_rel_err"] > 1e-2:
            raise AssertionError(f"lm_head_top1 at N={N}: {row}")
        row["ours_us"], row["ours_mode"] = self.timed(lambda: lm_head_top1(hidden, w))
        if baseline:
            row["eager_us"], row["eager_mode"] = self.timed(lambda: naive_lm_head.lm_head_top1(hidden, w))
            row["speedup"] = row["eager_us"] / row["ours_us"]
        row["ours_over_bound"] = row["ours_us"] / row["bound_us"]
        return row


def router_tail(logits: torch.Tensor, k: int):
    """What `patches.common.route_logits` computes for a renormalising router: (weights, ids)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(probs, k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype), ids


def route_case(bench: Bench, R: int, E: int, k: int, compiled_tail) -> dict:
    logits = torch.randn(R, E, device="cuda", generator=bench.gen).to(DTYPE)
    weights, ids = route_topk(logits, k)
    ref_weights, ref_ids = router_tail(logits, k)
    row = {"R": R, "E": E, "k": k, "ids_equal_rows": int((ids == ref_ids).all(-1).sum()), "of": R,
           "weights_rel_err": ((weights.float() - ref_weights.float()).norm() / ref_weights.float().norm()).item()}
    if row["weights_rel_err"] > 1e-2:
        raise AssertionError(f"route_topk at R={R}, E={E}, k={k}: {row}")
    row["ours_us"], row["ours_mode"] = bench.timed(lambda: route_topk(logits, k))
    row["eager_us"], row["eager_mode"] = bench.timed(lambda: router_tail(logits, k))
    row["compiled_us"], row["compiled_mode"] = bench.timed(lambda: compiled_tail(logits, k))
    row["speedup_vs_compiled"] = row["compiled_us"] / row["ours_us"]
    return row


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The projection as a compiled decoder layer holds it, for `torch.compile`."""
    return F.linear(x, w)


def linear_case(bench: Bench, M: int, N: int, K: int, compiled_linear=None, baseline: bool = True) -> dict:
    """small_linear on `x [M, K]` and a bf16 `[N, K]` weight, against cuBLAS (and, with
    `compiled_linear`, F.linear compiled), all captured in CUDA graphs."""
    x = torch.randn(M, K, device="cuda", generator=bench.gen).to(DTYPE)
    w = (torch.randn(N, K, device="cuda", generator=bench.gen) * K**-0.5).to(DTYPE)
    ours, ref = small_linear(x, w).float(), F.linear(x, w).float()
    copies = max(8, min(64, -(-CHAIN_BYTES // w.nbytes)))
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    row = {"M": M, "N": N, "K": K, "bound_us": N * K * w.element_size() / bench.bw * 1e6,
           "rel_err_vs_cublas": ((ours - ref).norm() / ref.norm()).item(),
           "max_err_vs_cublas": ((ours - ref).abs().max() / ref.abs().max()).item()}
    if not (row["rel_err_vs_cublas"] < 1e-2 and row["max_err_vs_cublas"] < 1e-2):
        raise AssertionError(f"small_linear at M={M}, N={N}, K={K}: {row}")
    row["ours_us"], row["ours_mode"] = bench.chained(lambda v: small_linear(x, v), weights)
    if baseline:
        row["cublas_us"], row["cublas_mode"] = bench.chained(lambda v: F.linear(x, v), weights)
        row["speedup"] = row["cublas_us"] / row["ours_us"]
        # cuBLAS on the transposed product W @ x^T ([N, M]: N is its long side), transposed back
        row["cublas_wxt_us"], _ = bench.chained(lambda v: torch.mm(v, x.t()).t().contiguous(), weights)
        row["ours_single_flushed_us"], _ = bench.timed(lambda: small_linear(x, w))
        row["cublas_single_flushed_us"], _ = bench.timed(lambda: F.linear(x, w))
        if compiled_linear is not None:
            row["compiled_us"], row["compiled_mode"] = bench.chained(lambda v: compiled_linear(x, v), weights)
            row["speedup_vs_compiled"] = row["compiled_us"] / row["ours_us"]
    row["ours_over_bound"] = row["ours_us"] / row["bound_us"]
    return row


def sweep(bench: Bench, module, configs: list[dict], run_case, cases, total: bool = False) -> dict:
    """Each config on every case (ours only); the best by its worst ratio to the bound, or with
    `total` by the sum of its times (cases that all run in every decode step)."""
    results = []
    for cfg in configs:
        try:
            with use_config(module, cfg):
                rows = [run_case(*c, baseline=False) for c in cases]
        # a config that fails to compile (out of resources) or to match: report and go on
        except Exception as exc:
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
            print(f"  failed  {cfg}  ({msg})")
            results.append({"config": cfg, "failed": msg})
            torch.cuda.synchronize()
            continue
        score = sum(r["ours_us"] for r in rows) if total else max(r["ours_over_bound"] for r in rows)
        results.append({"config": cfg, "us": [r["ours_us"] for r in rows], "score": score})
        print(f"  score {score:6.2f}  " + " ".join(f"{r['ours_us']:7.1f}" for r in rows) + f"  {cfg or '(defaults)'}")
    ok = [r for r in results if "score" in r]
    best = min(ok, key=lambda r: r["score"])["config"] if ok else {}
    for k, v in best.items():
        setattr(module.KERNEL_CONFIG, k, v)
    print(f"best: {best or '(defaults)'}")
    return {"cases": [str(c) for c in cases], "results": results, "best": best}


SECTIONS = ("attention", "lm_head", "router", "linear")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out/kernels.json")
    p.add_argument("--samples", type=int, default=50, help="replays per case (median of them)")
    p.add_argument("--new", type=int, default=1024, help="buffer positions past the context (the request's new tokens)")
    p.add_argument("--sweep", action="store_true", help="try a few kernel configs first, then run with the best")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="the sections to run (default: all)")
    args = p.parse_args()
    only = set(args.only)
    t0 = time.time()
    bench = Bench(args.samples, args.new)
    # kernel timings on random inputs: no drafter, so no acceptance, simulated or real
    report = {"env": env_info(), "copy_bw_TBps": bench.bw / 1e12, "samples": args.samples,
              "acceptance": "not applicable (kernel timings, no speculative decoding)"}
    env = report["env"]
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  transformers {env['transformers']}  "
          f"copy bandwidth {bench.bw / 1e12:.2f} TB/s (read+write)")
    attention_cases = [(L, W) for L in CONTEXTS for W in WIDTHS]
    linear_cases = [(M, N, K) for N, K in LINEAR_SHAPES for M in LINEAR_ROWS]
    if args.sweep and "attention" in only:
        print("attention sweep (us per case:", attention_cases, ")")
        report["attention_sweep"] = sweep(bench, attn_mod, ATTENTION_SWEEP, bench.attention_case, attention_cases)
    if args.sweep and "lm_head" in only:
        print("lm head sweep (us per N:", ROWS, ")")
        report["lm_head_sweep"] = sweep(bench, head_mod, HEAD_SWEEP, bench.head_case, [(n,) for n in ROWS])
    if args.sweep and "linear" in only:
        print("few-row linear sweep (us per case:", linear_cases, ")")
        report["linear_sweep"] = sweep(
            bench, linear_mod, LINEAR_SWEEP, lambda M, N, K, baseline: linear_case(bench, M, N, K, baseline=baseline),
            linear_cases, total=True)
    report["attention_config"] = dataclasses.asdict(attn_mod.KERNEL_CONFIG)
    report["lm_head_config"] = dataclasses.asdict(head_mod.KERNEL_CONFIG)
    report["linear_config"] = dataclasses.asdict(linear_mod.KERNEL_CONFIG)

    print("acceptance: not applicable (kernel timings, no speculative decoding)")
    rows = [bench.attention_case(L, W) for L, W in attention_cases] if "attention" in only else []
    report["attention"] = rows
    print(f"\ndecode attention, one layer: {HQ} query / {HKV} key heads, D = {D}, bf16, gate fused (us)")
    print_table(["L", "W", "buffer", "bound", "sdpa+mask", "ours", "speedup", "ours/bound", "err vs naive"],
                [[r["L"], r["W"], r["S"], r["bound_us"], r["sdpa_masked_us"], r["ours_us"], r["speedup"],
                  r["ours_over_bound"], f"{r['rel_err_vs_naive']:.1e}"] for r in rows])
    heads = [bench.head_case(n) for n in ROWS] if "lm_head" in only else []
    report["lm_head"] = heads
    print(f"\ndrafter LM head top-1: V = {VOCAB}, H = {HIDDEN}, bf16 (us)")
    print_table(["N", "bound", "eager", "ours", "speedup", "ours/bound", "tokens equal", "conf err", "entropy err"],
                [[r["N"], r["bound_us"], r["eager_us"], r["ours_us"], r["speedup"], r["ours_over_bound"],
                  f"{r['tokens_equal']}/{r['of']}", f"{r['confidence_rel_err']:.1e}", f"{r['entropy_rel_err']:.1e}"]
                 for r in heads])
    compiled_tail = torch.compile(router_tail, dynamic=False)
    routes = [route_case(bench, R, E, k, compiled_tail) for R, E, k in ROUTER_CASES] if "router" in only else []
    report["router"] = routes
    print("\nMoE router tail (softmax, top-k, renormalise) on bf16 logits (us)")
    print_table(["R", "E", "k", "eager", "compiled", "ours", "vs compiled", "ids equal (rows)", "weights err"],
                [[r["R"], r["E"], r["k"], r["eager_us"], r["compiled_us"], r["ours_us"], r["speedup_vs_compiled"],
                  f"{r['ids_equal_rows']}/{r['of']}", f"{r['weights_rel_err']:.1e}"] for r in routes])
    compiled_linear = torch.compile(linear, dynamic=False, fullgraph=True)
    # one static graph per shape: the cases outnumber dynamo's default recompile limit (8)
    with torch._dynamo.config.patch(recompile_limit=4 * len(linear_cases)):
        linears = [linear_case(bench, M, N, K, compiled_linear) for M, N, K in linear_cases] if "linear" in only else []
    report["linear"] = linears
    print(f"\nfew-row linear x [M, K] @ W.T, bf16 (us); config {dataclasses.asdict(linear_mod.KERNEL_CONFIG)}")
    print("(us per call, chained: distinct cold weights back to back in one graph; 'flushed': one call per replay after an L2 flush)")
    print_table(["M", "N", "K", "bound", "cuBLAS", "cuBLAS W@x^T", "compiled", "ours", "vs cuBLAS", "vs compiled",
                 "ours/bound", "cuBLAS flushed", "ours flushed", "err vs cuBLAS"],
                [[r["M"], r["N"], r["K"], r["bound_us"], r["cublas_us"], r["cublas_wxt_us"], r["compiled_us"], r["ours_us"],
                  r["speedup"], r["speedup_vs_compiled"], r["ours_over_bound"], r["cublas_single_flushed_us"],
                  r["ours_single_flushed_us"], f"{r['rel_err_vs_cublas']:.1e}"] for r in linears])
    modes = {r.get(k) for r in rows + heads + routes + linears
             for k in ("ours_mode", "sdpa_masked_mode", "eager_mode", "compiled_mode", "cublas_mode")} - {None}
    print("capture:", sorted(modes))
    write_json(args.out, report)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
