"""The weight-streaming kernels of one AR step, one launch each, for Nsight Compute (`ncu`).

At the Qwen3.6-35B-A3B shape (bf16, random weights, one row): the GDN layer's fused input
projection and the attention layer's q/k/v/gate projection (`F.linear`, cuBLAS, as the runner runs
them), an output projection as split-K partials (`small_linear_partials`, 4 splits), the MoE
router GEMM with the shared expert's gate row (`small_linear_partials`, 4 splits) and its top-k
(`route_topk_partials`), and the MoE experts at one row with the shared expert
(`moe_experts_partials`: gate/up and down kernels), the last under each `--moe` variant. Every
case is warmed up (Triton compiles) before the profiled range, which holds one launch of each
case in the printed order, so ncu's rows map to the printed labels one for one. Without ncu the
script times each case in a CUDA graph after an L2 flush, so it can also be run alone.

    ncu --profile-from-start off --clock-control none --cache-control all \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats --csv --page details \\
        python benchmarks/profile_ar_kernels.py --moe 'gate_up_block_i=16;num_stages=2' > ncu.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_runner import config_variant, config_variants  # noqa: E402
from benchmarks.common import capture, env_info, time_ms  # noqa: E402
from hybridspec.ops import moe_experts_partials, route_topk_partials, small_linear_partials  # noqa: E402

# the 35B-A3B shape
H, E, I, K = 2048, 256, 512, 8
GDN_IN = 2 * 16 * 128 + 32 * 128 + 32 * 128 + 2 * 32  # q, k, v, z, b, a
ATTN_QKV = 2 * 16 * 256 + 2 * 2 * 256  # q with its gate, k, v
OUT_IN = 4096  # the mixers' output projections: 4096 -> 2048
SPLITS = 4


def cases(moe_variants: list[dict]) -> list[tuple[str, callable]]:
    """(label, one call) per profiled case; each call allocates its own output."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=dev, dtype=torch.float32, generator=g) * 0.02).to(dt)

    x = w(1, H)
    x_out = w(1, OUT_IN)
    gdn_in, attn_qkv, out_proj, router = w(GDN_IN, H), w(ATTN_QKV, H), w(H, OUT_IN), w(E + 1, H)
    gate_up, down = w(E, 2 * I, H), w(E, H, I)
    s_gate_up, s_down = w(2 * I, H), w(H, I)
    ids = torch.randperm(E, device=dev, generator=g)[:K].view(1, K)
    num_tokens = torch.ones(1, dtype=torch.int64, device=dev)
    partials = small_linear_partials(x, router, SPLITS)
    out = [
        ("gdn in_proj (cuBLAS)", lambda: F.linear(x, gdn_in)),
        ("attention qkv (cuBLAS)", lambda: F.linear(x, attn_qkv)),
        (f"out_proj small_linear_partials x{SPLITS}", lambda: small_linear_partials(x_out, out_proj, SPLITS)),
        (f"router small_linear_partials x{SPLITS}", lambda: small_linear_partials(x, router, SPLITS)),
        ("route_topk_partials", lambda: route_topk_partials(partials, E, K)),
    ]
    for changes in [{}] + moe_variants:
        label = "moe experts " + (",".join(f"{k}={v}" for k, v in changes.items()) or "(default)")

        def run(changes=changes):
            with config_variant("moe", changes):
                return moe_experts_partials(x, ids, gate_up, down, num_tokens=num_tokens, shared=(s_gate_up, s_down))
        out.append((label, run))
    return out


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moe", default="", help="';'-separated MoEKernelConfig variants for the experts case")
    parser.add_argument("--time", action="store_true", help="also time each case (CUDA graph, L2 flushed)")
    args = parser.parse_args()
    variants = [changes for _, changes in config_variants(args.moe, "moe")]
    print(env_info())
    todo = []
    for label, fn in cases(variants):
        try:
            fn()
        except Exception as err:  # a variant whose tiles do not fit (Triton's OutOfResources) is left out
            print(f"left out: {label}: {type(err).__name__}: {str(err).splitlines()[0]}")
            continue
        todo.append((label, fn))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for label, fn in todo:
        with torch.cuda.nvtx.range(label):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    for i, (label, _) in enumerate(todo):
        print(f"case {i}: {label}")
    if args.time:
        flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        for label, fn in todo:
            graph = capture(fn)
            us = 1e3 * time_ms(graph.replay, replays=1, samples=50, before=lambda: flush.sum(dtype=torch.int32))
            print(f"{label}: {us:.1f} us (CUDA graph, one replay after an L2 flush by reads)")


if __name__ == "__main__":
    main()
