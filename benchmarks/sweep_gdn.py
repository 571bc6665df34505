"""Sweep launch configurations of the GDN kernels at the Qwen3.6 shape; per-kernel times and registers.

    python benchmarks/sweep_gdn.py

Times 30 verify launches (one per layer, CUDA graph) and one commit launch for each (BV, num_warps),
prints registers and spills of each compiled variant, and a profiler split of one default round.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_gdn import HK, HV, K, L, V, make_layers  # noqa: E402
from benchmarks.common import capture, print_table, time_ms  # noqa: E402
from hybridspec.ops import GDNFactors, gdn_commit, gdn_verify  # noqa: E402
from hybridspec.ops import gdn as gdn_mod  # noqa: E402
from hybridspec.ops.gdn_commit_triton import gdn_commit_kernel  # noqa: E402
from hybridspec.ops.gdn_verify_triton import gdn_verify_kernel  # noqa: E402


def compiled(kernel) -> dict:
    return {key: ck for cache in kernel.device_caches.values() for key, ck in cache[0].items()}


def regs_of_new(kernel, before: dict) -> str:
    new = [ck for key, ck in compiled(kernel).items() if key not in before]
    return ",".join(f"{ck.n_regs}r/{ck.n_spills}s" for ck in new) or "cached"


def main():
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(L, 1, HV, K, V, generator=gen).cuda()
    rows = []
    for w in (2, 16):
        layers = make_layers(w, gen)
        factors = GDNFactors(torch.empty(L, 1, w, HV, V, device="cuda"), torch.empty(L, 1, w, HK, K, device="cuda"),
                             torch.empty(L, 1, w, HV, device="cuda"))
        nc = torch.tensor([w], device="cuda")
        for prec, bv, bk, nw in itertools.chain(
            itertools.product(["tf32x3"], (16, 32, 64), (32, 64), (2, 4, 8)), [("tf32", 32, 32, 4)]
        ):
            gdn_mod.GPU_DOT_PRECISION = prec
            gdn_mod.VERIFY_CONFIG.update(BV=bv, BK=bk, num_warps=nw)
            gdn_mod.COMMIT_CONFIG.update(BV=min(bv, 32) if nw == 8 else bv, num_warps=nw)
            seen_v, seen_c = compiled(gdn_verify_kernel), compiled(gdn_commit_kernel)

            def verify():
                for i, (q, k, v, g, beta) in enumerate(layers):
                    gdn_verify(q, k, v, g, beta, states[i], factors_out=GDNFactors(*(x[i] for x in factors)))

            try:
                tv = time_ms(capture(verify).replay)
                tc = time_ms(capture(lambda: gdn_commit(states, factors, nc)).replay)
            except Exception as e:  # a config that does not compile is reported, not fatal
                print(f"w={w} BV={bv} BK={bk} warps={nw}: {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.append([w, prec, bv, bk, nw, tv, tc, regs_of_new(gdn_verify_kernel, seen_v), regs_of_new(gdn_commit_kernel, seen_c)])
            print(rows[-1], flush=True)
    print_table(["w", "precision", "BV", "BK", "warps", "verify x30 ms", "commit ms", "verify regs", "commit regs"], rows)

    gdn_mod.GPU_DOT_PRECISION = "tf32x3"
    gdn_mod.VERIFY_CONFIG.update(BV=32, BK=32, num_warps=4)
    gdn_mod.COMMIT_CONFIG.update(BV=32, num_warps=4)
    layers = make_layers(8, gen)
    factors = GDNFactors(torch.empty(L, 1, 8, HV, V, device="cuda"), torch.empty(L, 1, 8, HK, K, device="cuda"),
                         torch.empty(L, 1, 8, HV, device="cuda"))

    nc = torch.tensor([4], device="cuda")

    def round_():
        for i, (q, k, v, g, beta) in enumerate(layers):
            gdn_verify(q, k, v, g, beta, states[i], factors_out=GDNFactors(*(x[i] for x in factors)))
        gdn_commit(states, factors, nc)

    graph = capture(round_)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
