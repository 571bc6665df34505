"""Chains of dependent one-row GEMVs: one launch a layer (today's form) against one persistent
launch whose programs order the layers by counters, with and without loading weights before the
wait; and the same with a norm on the chain, as a kernel of its own or in every program's prologue.

The question it answers (docs/ar-step-levers.md, "What the field reports for the first route"): on
this GPU, at the AR step's sizes, does a persistent kernel save (a) the ~2-3.5 us that each weight
kernel loses at its ends and (b) the ~2 us of each latency-bound link, which a persistent kernel's
programs remove by computing the link themselves (Hazy Research's and Cohere's megakernels recompute
the norm in every consumer)? `y[l + 1] = W[l] @ y[l]` (chain "plain") or `W[l] @ norm(y[l])` (chain
"normed": RMSNorm with a zero-centred weight, as these families'), `L` layers of `[D, D]` bf16
weights, one row, outputs rounded to bf16, every row inside a CUDA graph, the same weights and input:

- `small_linear` (PDL): L launches of the project's own GEMV kernel, one split of K (each output
  summed by one program). The AR step splits its output projections' K four ways and sums them in
  the consumer's kernel; a chain has no consumer kernel, so every row here takes one split.
- `F.linear` (cuBLAS): L launches, for reference; and `F.linear` compiled with the runner's
  layer options, which at one row is inductor's tuned reduction kernel (the AR step's input
  projections run there, at ~2.9 TB/s on an H100).
- persistent: one launch of one program per SM. Program p computes the output tiles p, p + P, ...
  of each layer with `small_linear`'s tiles and K order (so the same bits), then adds one to the
  layer's counter (release, after a block barrier); before a layer it waits until the previous
  layer's counter reaches P (acquire). "first K step before the wait": it loads its first tile's
  first `BLOCK_K` columns of weights before that wait, the overlap PDL does not give. Besides the
  launch the graph holds one copy of x and one reset of the counters.
- normed chain: a one-program norm kernel then `small_linear` (two launches a layer, today's form);
  one launch a layer whose programs each take the norm's scale themselves (the launch-form fusion);
  the persistent kernel with the norm in its prologue. The scale is summed in one fixed order in
  every form.

Per layer: the graph's time over L. Acceptance: not applicable (no drafts, no model). Every
program must be resident at once, so the grid is the SM count. Each row is checked against its
chain's first row before its time is reported: a relative error above 1e-2 (a layer read before it
was done) stops the run; `same_bits` says whether the bits agree. A persistent program that has
spun `MAX_SPINS` loads gives up and raises an error flag instead of hanging the GPU, and the run
stops with that error.

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
from hybridspec.ops.pdl_triton import pdl_enter  # noqa: E402
from benchmarks.sync_cost import MAX_SPINS, check_waits, report_gave_up, spin_until  # noqa: E402

ACCEPTANCE = "not applicable (no drafts, no model)"
# small_linear's tiles at one row (LinearKernelConfig: block_n 16, block_k 256, 4 warps)
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS = 16, 16, 256, 4
EPS = 1e-6


@triton.jit
def _scale(y_in, D, eps, BLOCK_K: tl.constexpr):
    """The row's RMSNorm scale, rsqrt(mean(y^2) + eps) in fp32, summed in BLOCK_K steps in order
    (every form below calls this, so every form gets the same bits)."""
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        v = tl.load(y_in + k0 + tl.arange(0, BLOCK_K), cache_modifier=".cg").to(tl.float32)
        acc += v * v
    return tl.rsqrt(tl.sum(acc, 0) / D + eps)


@triton.jit
def _normed(x, g, s, INTERPRET: tl.constexpr):
    """bf16 `x` normed by the scale `s` and the zero-centred weight `g` (`x s (1 + g)`, as these
    families' RMSNorm), rounded back to x's dtype."""
    v = x.to(tl.float32) * s * (1.0 + g.to(tl.float32))
    if INTERPRET:
        v = _round_bf16(v)
    return v.to(x.dtype)


@triton.jit
def _tile(y_in, w_ptr, y_out, g_ptr, t, D, s_w, eps, w_first, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """Output features [t BLOCK_N, (t + 1) BLOCK_N) of one layer, `w_first` its first K step; with
    NORM the input row is normed on the way in (each program takes the scale itself)."""
    rows = tl.arange(0, BLOCK_M)
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + cols[:, None].to(tl.int64) * s_w
    scale = 1.0
    if NORM:
        scale = _scale(y_in, D, eps, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w = w_first
    for k0 in range(0, D, BLOCK_K):
        ck = k0 + tl.arange(0, BLOCK_K)
        # the activations were written by other SMs in this launch: read them past L1
        x = tl.load(y_in + rows[:, None] * 0 + ck[None, :], mask=(rows[:, None] < 1), other=0.0, cache_modifier=".cg")
        if NORM:
            x = _normed(x, tl.load(g_ptr + ck)[None, :], scale, INTERPRET)
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
def _norm_kernel(y_in, g_ptr, out_ptr, D, eps, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """The row normed, as a kernel of its own (one program): today's form of a norm on the chain."""
    pdl_enter(USE_PDL)
    scale = _scale(y_in, D, eps, BLOCK_K)
    for k0 in range(0, D, BLOCK_K):
        ck = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + ck, _normed(tl.load(y_in + ck), tl.load(g_ptr + ck), scale, INTERPRET))


@triton.jit
def _gemv_kernel(y_in, w_ptr, y_out, g_ptr, D, s_w, eps, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """One layer as one launch of one program per tile (`small_linear`'s form), with NORM the norm
    in every program's prologue: the launch-form fusion, for comparison with the persistent one."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    w_first = tl.load(w_ptr + cols[:, None].to(tl.int64) * s_w + tl.arange(0, BLOCK_K)[None, :])
    _tile(y_in, w_ptr, y_out, g_ptr, t, D, s_w, eps, w_first, NORM, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRET)


@triton.jit
def _chain_kernel(y_ptr, w_ptr, g_ptr, done_ptr, err_ptr, layers, D, s_w, s_wl, eps, spins, NORM: tl.constexpr,
                  PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles = D // BLOCK_N
    first_cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ck0 = tl.arange(0, BLOCK_K)
    budget = spins
    for layer in range(layers):
        w_layer = w_ptr + tl.cast(layer, tl.int64) * s_wl
        y_in = y_ptr + tl.cast(layer, tl.int64) * D
        y_out = y_in + D
        first = w_layer + first_cols[:, None].to(tl.int64) * s_w + ck0[None, :]
        if PREFETCH:
            # this program's first tile's first K step, before the previous layer is done
            w_first = tl.load(first, mask=pid < tiles)
        if layer > 0:
            budget = spin_until(done_ptr + layer - 1, programs, budget, False)
        if not PREFETCH:
            w_first = tl.load(first, mask=pid < tiles)
        for t in range(pid, tiles, programs):
            if t != pid:
                cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
                w_first = tl.load(w_layer + cols[:, None].to(tl.int64) * s_w + ck0[None, :])
            _tile(y_in, w_layer, y_out, g_ptr, t, D, s_w, eps, w_first, NORM, BLOCK_M, BLOCK_N, BLOCK_K,
                  PRECISION, INTERPRET)
        # every warp's stores before the one thread's release
        tl.debug_barrier()
        tl.atomic_add(done_ptr + layer, 1, sem="release", scope="gpu")
    report_gave_up(budget, err_ptr)


def check_shapes(x: torch.Tensor, weights: torch.Tensor) -> None:
    if weights.dim() != 3 or weights.shape[1] != weights.shape[2]:
        raise ValueError(f"weights must be [L, D, D], got {tuple(weights.shape)}")
    D = weights.shape[1]
    if x.shape != (D,) or D % BLOCK_K or D % BLOCK_N:
        raise ValueError(f"x must be [{D}] and D a multiple of {BLOCK_K}, got x {tuple(x.shape)}")
    if x.dtype != weights.dtype or not weights.is_contiguous():
        raise ValueError("x and the weights must share a dtype and the weights be contiguous")


def persistent_chain(x: torch.Tensor, weights: torch.Tensor, programs: int, prefetch: bool,
                     norm_weight: torch.Tensor | None = None, err: torch.Tensor | None = None,
                     spins: int = MAX_SPINS) -> list[torch.Tensor]:
    """`[x, y1, ..., yL]` from one launch of `programs` programs (all resident at once on a GPU; one
    under the interpreter, which runs programs one after another), each layer's input normed first
    where `norm_weight` is given. Besides the launch: one copy of `x` and one reset of the counters.
    `err` (int32, one element) is set where a program gave up waiting after `spins` loads."""
    from benchmarks.common import check_resident

    check_shapes(x, weights)
    check_resident(programs, x)
    L, D = weights.shape[0], weights.shape[1]
    norm = norm_weight is not None
    ys = torch.empty(L + 1, D, dtype=x.dtype, device=x.device)
    done = torch.zeros(L, dtype=torch.int32, device=x.device)
    err = torch.zeros(1, dtype=torch.int32, device=x.device) if err is None else err
    ys[0].copy_(x)
    _chain_kernel[(programs,)](ys, weights, norm_weight if norm else x, done, err, L, D, weights.stride(1),
                               weights.stride(0), EPS, spins, NORM=norm, PREFETCH=prefetch, BLOCK_M=BLOCK_M,
                               BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=dot_precision(x),
                               INTERPRET=TRITON_INTERPRET, num_warps=NUM_WARPS)
    return list(ys.unbind(0))


def launched_chain(x: torch.Tensor, weights: torch.Tensor, linear) -> list[torch.Tensor]:
    """`[x, y1, ..., yL]` as one launch of `linear(row [1, D], weight)` a layer (nothing else)."""
    check_shapes(x, weights)
    ys = [x[None]]
    for w in weights.unbind(0):
        ys.append(linear(ys[-1], w))
    return [y[0] for y in ys]


def normed_launched_chain(x: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor,
                          fused: bool) -> list[torch.Tensor]:
    """`[x, y1, ..., yL]` with each layer's input normed: a norm kernel then `small_linear` (two
    launches a layer, today's form), or (`fused`) one launch a layer whose programs each take the
    norm themselves. PDL on both, as on every kernel of ours."""
    from hybridspec.ops.dispatch import pdl_launch, use_pdl
    from hybridspec.ops.linear import small_linear

    check_shapes(x, weights)
    D = x.shape[0]
    pdl = use_pdl(x)
    ys = [x]
    for w in weights.unbind(0):
        out = torch.empty_like(x)
        if fused:
            _gemv_kernel[(D // BLOCK_N,)](ys[-1], w, out, norm_weight, D, w.stride(0), EPS, NORM=True, BLOCK_M=BLOCK_M,
                                          BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=dot_precision(x),
                                          INTERPRET=TRITON_INTERPRET, USE_PDL=pdl, num_warps=NUM_WARPS,
                                          **pdl_launch(pdl))
        else:
            _norm_kernel[(1,)](ys[-1], norm_weight, out, D, EPS, BLOCK_K=BLOCK_K, INTERPRET=TRITON_INTERPRET,
                               USE_PDL=pdl, num_warps=NUM_WARPS, **pdl_launch(pdl))
            out = small_linear(out[None], w)[0]
        ys.append(out)
    return ys


def main() -> None:
    from benchmarks.common import capture, print_table, start_gpu_run, time_ms, write_json
    from hybridspec.ops.dispatch import layer_options
    from hybridspec.ops.linear import small_linear

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=4096, help="D: each layer's weight is [D, D] bf16 (4096: 33.5 MB)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default="bench_out/chain_gemv")
    args = parser.parse_args()
    info = start_gpu_run("chain_gemv.py", ACCEPTANCE)
    torch.backends.cuda.matmul.allow_tf32 = False
    L, D = args.layers, args.dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = (torch.randn(L, D, D, device="cuda", generator=gen) / D**0.5).to(torch.bfloat16)
    x = torch.randn(D, device="cuda", generator=gen).to(torch.bfloat16)
    g = (0.1 * torch.randn(D, device="cuda", generator=gen)).to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bytes_per_layer = D * D * weights.element_size()
    # the runner's compile options: with coordinate-descent tuning on, inductor lowers a one-row
    # matmul to a tuned reduction kernel of its own (the AR step's input projections run there)
    compiled_linear = torch.compile(torch.nn.functional.linear, options=layer_options(), dynamic=False)
    # set by a persistent row's program that gave up waiting (checked after each row's first replay)
    err = torch.zeros(1, dtype=torch.int32, device="cuda")

    # (chain, row, run, is the reference of its chain)
    runs = [
        ("plain", "small_linear (PDL), one launch a layer", lambda: launched_chain(x, weights, small_linear), True),
        ("plain", "F.linear (cuBLAS), one launch a layer",
         lambda: launched_chain(x, weights, torch.nn.functional.linear), False),
        ("plain", "F.linear compiled as the layers are (inductor's one-row reduction), one launch a layer",
         lambda: launched_chain(x, weights, compiled_linear), False),
        ("plain", "persistent, wait then load", lambda: persistent_chain(x, weights, sms, False, err=err), False),
        ("plain", "persistent, first K step loaded before the wait",
         lambda: persistent_chain(x, weights, sms, True, err=err), False),
        ("normed", "norm kernel + small_linear (PDL), two launches a layer",
         lambda: normed_launched_chain(x, weights, g, fused=False), True),
        ("normed", "norm in each program's prologue (PDL), one launch a layer",
         lambda: normed_launched_chain(x, weights, g, fused=True), False),
        ("normed", "persistent, norm in the prologue, wait then load",
         lambda: persistent_chain(x, weights, sms, False, g, err=err), False),
        ("normed", "persistent, norm in the prologue, first K step before the wait",
         lambda: persistent_chain(x, weights, sms, True, g, err=err), False),
    ]
    rows, want = [], {}
    for chain, name, run, reference in runs:
        box = {}
        graph = capture(lambda run=run, box=box: box.update(ys=run()))
        graph.replay()
        torch.cuda.synchronize()
        check_waits(err, name)
        got = torch.stack(box["ys"]).float()
        if reference:
            want[chain] = got.clone()
        same = bool(torch.equal(got, want[chain]))
        err = ((got - want[chain]).norm() / want[chain].norm()).item()
        # a layer read before it was done shows as an error of the order of the values; another
        # instruction order only as bf16 rounding (reported as `same_bits`)
        if err > 1e-2:
            raise SystemExit(f"{name}: the chain differs from its reference row's (relative error {err:.2e})")
        ms = time_ms(graph.replay, replays=10, samples=30)
        us = ms * 1e3 / L
        rows.append(dict(chain=chain, row=name, us_per_layer=us, weight_tb_per_s=bytes_per_layer / (us * 1e-6) / 1e12,
                         same_bits_as_reference=same, relative_error=err))
    print(f"{L} layers of [{D}, {D}] bf16 ({bytes_per_layer / 1e6:.1f} MB each), one row, {sms} programs for the "
          "persistent rows; the first row of each chain is its reference")
    print_table(["chain", "row", "us per layer", "weights TB/s", "same bits", "relative error"],
                [[r["chain"], r["row"], r["us_per_layer"], r["weight_tb_per_s"], r["same_bits_as_reference"],
                  r["relative_error"]] for r in rows])
    write_json(Path(args.out) / "chain_gemv.json",
               dict(env=info, acceptance=ACCEPTANCE, dim=D, layers=L, sms=sms, bytes_per_layer=bytes_per_layer,
                    tiles=dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS), rows=rows))


if __name__ == "__main__":
    main()
