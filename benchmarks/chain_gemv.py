"""A chain of dependent one-row GEMVs: one launch each (today's form) against one persistent launch
whose programs order the layers by counters, with and without loading weights before the wait.

The question it answers (docs/ar-step-levers.md, "What the field reports for the first route"):
does a persistent kernel save the ~2-3.5 us that each weight kernel of the AR step loses at its
ends, on this GPU, at the step's sizes? `y[l + 1] = W[l] @ y[l]`, `L` layers of `[D, D]` bf16
weights, one row, outputs rounded to bf16, every row inside a CUDA graph, the same weights and input:

- `small_linear` (PDL): L launches of the project's own GEMV kernel, as the AR step launches its
  output projections (one split of K: each output summed by one program).
- `F.linear` (cuBLAS): L launches, for reference. (The AR step splits its output projections' K
  four ways and sums the splits in the consumer's kernel; a chain has no consumer kernel to sum
  in, so both sides here take one split.)
- `persistent`: one launch of one program per SM. Program p computes the output tiles p, p + P,
  ... of each layer with the same tiles and the same K order as `small_linear` (so the same bits),
  then adds one to the layer's counter (release, after a block barrier); before a layer it waits
  until the previous layer's counter reaches P (acquire). With `prefetch` it loads the first
  `BLOCK_K` columns of its first tile's weights before that wait, the overlap PDL does not give.

Per layer: the graph's time over L. Acceptance: not applicable (no drafts, no model). Every
program must be resident at once, so the grid is the SM count; the persistent rows are checked
against the `small_linear` chain before their times are reported (a relative error above 1e-2 stops
the run: a layer read before it was done; `same_bits` says whether the bits agree).

    python benchmarks/chain_gemv.py [--dim 4096] [--layers 32] [--out bench_out/chain_gemv]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridspec.ops.checks import dot_precision  # noqa: E402
from hybridspec.ops.dispatch import TRITON_INTERPRET  # noqa: E402
from hybridspec.ops.moe_triton import _round_bf16  # noqa: E402

ACCEPTANCE = "not applicable (no drafts, no model)"
# small_linear's tiles at one row (LinearKernelConfig: block_n 16, block_k 256, 4 warps)
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS = 16, 16, 256, 4


@triton.jit
def _tile(y_in, w_ptr, y_out, t, D, s_w, w_first, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """Output features [t BLOCK_N, (t + 1) BLOCK_N) of one layer, `w_first` its first K step."""
    rows = tl.arange(0, BLOCK_M)
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + cols[:, None].to(tl.int64) * s_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w = w_first
    for k0 in range(0, D, BLOCK_K):
        ck = k0 + tl.arange(0, BLOCK_K)
        # the activations were written by other SMs in this launch: read them past L1
        x = tl.load(y_in + rows[:, None] * 0 + ck[None, :], mask=(rows[:, None] < 1), other=0.0, cache_modifier=".cg")
        if k0 > 0:
            w = tl.load(w_base + ck[None, :])
        if INTERPRET:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if INTERPRET:
        acc = _round_bf16(acc)
    out = y_out + rows[:, None] * 0 + cols[None, :]
    tl.store(out, acc.to(y_out.dtype.element_ty), mask=rows[:, None] < 1)


@triton.jit
def _chain_kernel(y_ptr, w_ptr, done_ptr, layers, D, s_w, s_wl,
                  PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles = D // BLOCK_N
    first_cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ck0 = tl.arange(0, BLOCK_K)
    for layer in range(layers):
        w_layer = w_ptr + tl.cast(layer, tl.int64) * s_wl
        y_in = y_ptr + tl.cast(layer, tl.int64) * D
        y_out = y_in + D
        w_first = tl.zeros([BLOCK_N, BLOCK_K], dtype=w_ptr.dtype.element_ty)
        if PREFETCH:
            # this program's first tile's first K step, before the previous layer is done
            w_first = tl.load(w_layer + first_cols[:, None].to(tl.int64) * s_w + ck0[None, :], mask=pid < tiles)
        if layer > 0:
            seen = tl.atomic_add(done_ptr + layer - 1, 0, sem="acquire", scope="gpu")
            while seen < programs:
                seen = tl.atomic_add(done_ptr + layer - 1, 0, sem="acquire", scope="gpu")
        if not PREFETCH:
            w_first = tl.load(w_layer + first_cols[:, None].to(tl.int64) * s_w + ck0[None, :], mask=pid < tiles)
        for t in range(pid, tiles, programs):
            if t != pid:
                cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
                w_first = tl.load(w_layer + cols[:, None].to(tl.int64) * s_w + ck0[None, :])
            _tile(y_in, w_layer, y_out, t, D, s_w, w_first, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRET)
        # every warp's stores before the one thread's release
        tl.debug_barrier()
        tl.atomic_add(done_ptr + layer, 1, sem="release", scope="gpu")


def check_shapes(x: torch.Tensor, weights: torch.Tensor) -> None:
    if weights.dim() != 3 or weights.shape[1] != weights.shape[2]:
        raise ValueError(f"weights must be [L, D, D], got {tuple(weights.shape)}")
    D = weights.shape[1]
    if x.shape != (D,) or D % BLOCK_K or D % BLOCK_N:
        raise ValueError(f"x must be [{D}] and D a multiple of {BLOCK_K}, got x {tuple(x.shape)}")
    if x.dtype != weights.dtype or not weights.is_contiguous():
        raise ValueError("x and the weights must share a dtype and the weights be contiguous")


def persistent_chain(x: torch.Tensor, weights: torch.Tensor, programs: int, prefetch: bool,
                     ys: torch.Tensor | None = None, done: torch.Tensor | None = None) -> torch.Tensor:
    """`ys [L + 1, D]`: `x`, then each layer's output, from one launch of `programs` programs (all
    resident at once on a GPU; one under the interpreter, which runs programs one after another).
    `ys` and `done` may be passed to reuse buffers (a captured graph's)."""
    check_shapes(x, weights)
    L, D = weights.shape[0], weights.shape[1]
    ys = torch.empty(L + 1, D, dtype=x.dtype, device=x.device) if ys is None else ys
    done = torch.empty(L, dtype=torch.int32, device=x.device) if done is None else done
    ys[0].copy_(x)
    done.zero_()
    _chain_kernel[(programs,)](ys, weights, done, L, D, weights.stride(1), weights.stride(0),
                               PREFETCH=prefetch, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                               PRECISION=dot_precision(x), INTERPRET=TRITON_INTERPRET, num_warps=NUM_WARPS)
    return ys


def launched_chain(x: torch.Tensor, weights: torch.Tensor, linear, ys: torch.Tensor | None = None) -> torch.Tensor:
    """The same chain as one launch of `linear(row [1, D], weight)` per layer."""
    L, D = weights.shape[0], weights.shape[1]
    ys = torch.empty(L + 1, D, dtype=x.dtype, device=x.device) if ys is None else ys
    ys[0].copy_(x)
    for layer in range(L):
        ys[layer + 1].copy_(linear(ys[layer][None], weights[layer])[0])
    return ys


def main() -> None:
    from benchmarks.common import capture, env_info, print_table, time_ms, write_json
    from hybridspec.ops.linear import small_linear

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=4096, help="D: each layer's weight is [D, D] bf16 (4096: 33.5 MB)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default="bench_out/chain_gemv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("chain_gemv.py measures a GPU: CUDA is not available")
    info = env_info()
    print(info)
    print(f"acceptance: {ACCEPTANCE}")
    torch.backends.cuda.matmul.allow_tf32 = False
    L, D = args.layers, args.dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = (torch.randn(L, D, D, device="cuda", generator=gen) / D**0.5).to(torch.bfloat16)
    x = torch.randn(D, device="cuda", generator=gen).to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bytes_per_layer = D * D * weights.element_size()

    rows = []
    want = launched_chain(x, weights, small_linear)
    runs = {
        "small_linear (PDL), one launch a layer": lambda ys: launched_chain(x, weights, small_linear, ys),
        "F.linear (cuBLAS), one launch a layer": lambda ys: launched_chain(x, weights, torch.nn.functional.linear, ys),
        "persistent, wait then load": lambda ys: persistent_chain(x, weights, sms, False, ys),
        "persistent, first K step loaded before the wait": lambda ys: persistent_chain(x, weights, sms, True, ys),
    }
    for name, run in runs.items():
        ys = torch.empty(L + 1, D, dtype=x.dtype, device="cuda")
        graph = capture(lambda run=run, ys=ys: run(ys))
        graph.replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(ys, want))
        err = ((ys.float() - want.float()).norm() / want.float().norm()).item()
        # a read before its layer was done shows as an error of the order of the values; a different
        # instruction order only as bf16 rounding (reported as `same_bits`)
        if name.startswith("persistent") and err > 1e-2:
            raise SystemExit(f"{name}: the chain differs from small_linear's (relative error {err:.2e})")
        ms = time_ms(graph.replay, replays=10, samples=30)
        us = ms * 1e3 / L
        rows.append(dict(row=name, us_per_layer=us, tb_per_s=bytes_per_layer / (us * 1e-6) / 1e12,
                         same_bits_as_small_linear=same, relative_error=err))
    print(f"{L} layers of [{D}, {D}] bf16 ({bytes_per_layer / 1e6:.1f} MB each), one row, {sms} programs for the persistent rows")
    print_table(["row", "us per layer", "TB/s", "same bits as small_linear", "relative error"],
                [[r["row"], r["us_per_layer"], r["tb_per_s"], r["same_bits_as_small_linear"], r["relative_error"]] for r in rows])
    write_json(Path(args.out) / "chain_gemv.json",
               dict(env=info, acceptance=ACCEPTANCE, dim=D, layers=L, sms=sms, bytes_per_layer=bytes_per_layer,
                    tiles=dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS), rows=rows))


if __name__ == "__main__":
    main()
