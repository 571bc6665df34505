"""Registers, spills and shared memory of our Triton kernels compiled for sm90, on any machine.

Each kernel is compiled for an H100/H200 (sm90, PDL on) at the 35B-A3B shapes the runner launches,
with the installed Triton and the ptxas in its wheel, and never launched: no GPU is needed. Then
`cuobjdump -res-usage` reads the registers a thread takes, the bytes a thread spills to its local
stack and the static shared memory; Triton's metadata adds the dynamic shared memory a block asks
for. A spilling kernel makes round trips to local memory. Tiles too large for the registers show up
here before any GPU time is spent on them, and the table can be redone after a change.

    python benchmarks/kernel_resources.py                       # the default rows
    python benchmarks/kernel_resources.py --only gdn_verify     # the rows whose name starts so

The GPU machines may run another Triton than this machine (the figures say which compiled them),
so the counts are the compiler's view, not a timing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ACCEPTANCE = "not applicable (compiled kernels, nothing runs)"
# the 35B-A3B GDN heads (16 key, 32 value, 128 wide) and one MoE piece of 16 rows at top-8
GDN = dict(HK=16, HV=32, K=128, V=128, BT=16)
MOE = dict(H=2048, I=512, K=8, BM=16, KP=8, SP=128, RB=16, GATHER=False)
INTEGER_POINTERS = ("ids_ptr", "num_tokens_ptr")


def compile_sm90(kernel, dtype: str, constexprs: dict, fp32_pointers=(), num_warps: int = 4,
                 types: dict | None = None, num_stages: int = 3, ints: dict | None = None):
    """`kernel` compiled for sm90 as the JIT compiles a launch: pointers of `dtype` (int64 for ids
    and lengths, fp32 for `fp32_pointers`), `types` by name where given, other runtime arguments
    int32.

    A launch specializes its arguments, and the code depends on it: every pointer here carries the
    16-byte alignment hint that torch's allocations earn it (without the hint the loads cannot be
    vectorized or pipelined: the experts' gate/up kernel then stages nothing in shared memory and
    spills), and each `ints` value (the integer arguments the runner passes, by name) is specialized
    by Triton's own rule: 1 becomes a constant, a multiple of 16 gets the divisibility hint. Integer
    arguments left out of `ints` get neither, as a launch with an odd value would."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    constexprs, ints = dict(constexprs), ints or {}
    unknown = set(ints) - set(kernel.arg_names)
    if unknown:
        raise ValueError(f"{kernel.fn.__name__} has no integer arguments {sorted(unknown)}")
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        spec = ""
        if name in ints:
            kind, spec = native_specialize_impl(BaseBackend, ints[name], False, True, True)
            if kind == "constexpr":
                signature[name], constexprs[name] = "constexpr", spec
                continue
        elif types and name in types:
            kind = types[name]
        elif name in INTEGER_POINTERS:
            kind = "*i64"
        elif name.endswith("_ptr"):
            kind = "*fp32" if name in fp32_pointers else f"*{dtype}"
        else:
            kind = "i32"
        signature[name] = kind
        if kind.startswith("*"):
            spec = "D"
        if spec:
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resources(compiled) -> dict:
    """Registers and spill stack per thread, static (`cuobjdump -res-usage` on its cubin) and
    dynamic (Triton's metadata) shared memory per block of a compiled kernel, and whether its PTX
    has tensor-core instructions."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(tool), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    if found is None:
        raise SystemExit(f"cuobjdump printed no resource line:\n{text}")
    regs, stack, shared = (int(x) for x in found.groups())
    ptx = compiled.asm["ptx"]
    return dict(registers=regs, spill_stack_bytes=stack, static_shared_bytes=shared,
                shared_bytes=int(compiled.metadata.shared), tensor_cores="mma" in ptx or "wgmma" in ptx)


def verify(one_row: bool, BV: int = 32, BK: int = 64, num_warps: int = 4, rows: int = 1):
    """`gdn_verify_kernel` as the runner launches it on `rows` tokens (1: the AR step, 16: a round):
    bf16 q, k, v and o, fp32 state and factors, lengths on the device, 3xTF32 dots. q, k and v are
    views of the conv's output row (2 x 16 x 128 + 32 x 128 wide), g and beta rows of 32 heads: every
    stride a multiple of 16."""
    from hybridspec.ops.gdn_verify_triton import gdn_verify_kernel

    width, heads = 2 * GDN["HK"] * GDN["K"] + GDN["HV"] * GDN["V"], GDN["HV"]
    strides = dict(sqb=rows * width, sqt=width, sqh=GDN["K"], skb=rows * width, skt=width, skh=GDN["K"],
                   svb=rows * width, svt=width, svh=GDN["V"], sgb=rows * heads, sgt=heads, sbb=rows * heads,
                   sbt=heads)
    return compile_sm90(gdn_verify_kernel, "bf16",
                        dict(GDN, BV=BV, BK=BK, HAS_NUM_TOKENS=True, USE_L2NORM=True, PRECISION="tf32x3",
                             USE_PDL=True, ONE_ROW=one_row),
                        fp32_pointers=("g_ptr", "beta_ptr", "state_ptr", "z_ptr", "kn_ptr", "gcum_ptr"),
                        num_warps=num_warps, types={"scale": "fp32"}, ints=dict(T=rows, **strides))


def verify_gated(BK: int = 32, num_warps: int = 8):
    """`gdn_verify_gated_kernel` as the AR step launches it (`hybridspec.ops.gdn_gated`): one
    program per value head holding its 128 columns, the gate a view of the fused input projection's
    output row (12,352 columns at the 35B-A3B shape: q, k and v 8,192, z 4,096, b and a 32 each),
    a bf16 norm weight."""
    from hybridspec.ops.gdn_verify_gated_triton import gdn_verify_gated_kernel

    width, heads = 2 * GDN["HK"] * GDN["K"] + GDN["HV"] * GDN["V"], GDN["HV"]
    strides = dict(sqb=width, sqh=GDN["K"], skb=width, skh=GDN["K"], svb=width, svh=GDN["V"], sgb=heads,
                   sbb=heads, sgateb=width + heads * GDN["V"] + 2 * heads, sgateh=GDN["V"])
    return compile_sm90(gdn_verify_gated_kernel, "bf16",
                        dict({k: GDN[k] for k in ("HK", "HV", "K", "V")}, BK=BK, HAS_NUM_TOKENS=True,
                             USE_L2NORM=True, ROUND_INPUT=True, ROUND_PRODUCT=True, USE_PDL=True),
                        fp32_pointers=("g_ptr", "beta_ptr", "state_ptr", "z_ptr", "kn_ptr", "gcum_ptr"),
                        num_warps=num_warps, types={"scale": "fp32", "eps": "fp32"}, ints=strides)


def moe(kind: str, rows: int = 1, **changes):
    """The experts' gate/up or down kernel (bf16, shared expert, 256 experts) on `rows` rows (1: the
    AR step, 16: a round) at the default `MoEKernelConfig` with `changes`."""
    from dataclasses import replace

    from hybridspec.ops import moe_triton
    from hybridspec.ops.moe import KERNEL_CONFIG

    cfg = replace(KERNEL_CONFIG, **changes)
    flags = dict(HAS_NUM_TOKENS=True, HAS_SHARED=True, INTERPRET_BF16=False, USE_PDL=True, PRECISION="tf32")
    ints = dict(T=rows, E=256, row_off=0)
    if kind == "gate_up":
        return compile_sm90(moe_triton.moe_gate_up_kernel, "bf16",
                            dict(MOE, **flags, BN=cfg.gate_up_block_i, BK=cfg.gate_up_block_h,
                                 BK_WIDE=cfg.gate_up_block_h, WRITE_ZEROS=False, ZB=256),
                            fp32_pointers=("y_ptr",), num_warps=cfg.gate_up_warps, num_stages=cfg.num_stages,
                            ints=dict(ints, s_xt=MOE["H"]))
    dims = {k: MOE[k] for k in ("H", "I", "K", "BM", "KP", "SP", "RB", "GATHER")}
    return compile_sm90(moe_triton.moe_down_kernel, "bf16",
                        dict(dims, **flags, BN=cfg.down_block_h, BK=cfg.down_block_i, WRITE_ALL=True),
                        fp32_pointers=("y_ptr",), num_warps=cfg.down_warps, num_stages=cfg.num_stages, ints=ints)


def small_linear(rows: int = 1, **changes):
    """`small_linear_kernel` on `rows` rows (1: the AR step) at the default `LinearKernelConfig` with
    `changes`, as the GDN output projection (4096 -> 2048) in its default 4 K splits (partials in
    fp32)."""
    from dataclasses import replace

    from hybridspec.ops.linear import KERNEL_CONFIG
    from hybridspec.ops.linear_triton import small_linear_kernel

    cfg = replace(KERNEL_CONFIG, **changes)
    return compile_sm90(small_linear_kernel, "bf16",
                        dict(BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION="tf32", UPCAST=False,
                             INTERPRET_BF16=False, USE_PDL=True),
                        fp32_pointers=("out_ptr",), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                        ints=dict(M=rows, N=2048, K=4096, k_span=4096 // cfg.out_split_k, s_xm=4096, s_wn=4096))


def chain_gemv(kernel: str = "chain", norm: bool = False, prefetch: bool = True):
    """`benchmarks/chain_gemv.py`'s kernels at D = 4096 as it launches them: the persistent chain
    (`chain`), the launched GEMV with the norm in its prologue (`gemv`), the norm kernel (`norm`)."""
    from benchmarks import chain_gemv as cg

    tiles = dict(BLOCK_M=cg.BLOCK_M, BLOCK_N=cg.BLOCK_N, BLOCK_K=cg.BLOCK_K, PRECISION="tf32", INTERPRET=False)
    # the launched kernels name their activations y_in / y_out, not *_ptr
    types = {"done_ptr": "*i32", "err_ptr": "*i32", "eps": "fp32", "y_in": "*bf16", "y_out": "*bf16"}
    ints = dict(D=4096, s_w=4096)
    if kernel == "chain":
        return compile_sm90(cg._chain_kernel, "bf16", dict(NORM=norm, PREFETCH=prefetch, **tiles), num_warps=cg.NUM_WARPS,
                            types=types, ints=dict(ints, s_wl=4096 * 4096))
    if kernel == "gemv":
        return compile_sm90(cg._gemv_kernel, "bf16", dict(NORM=True, USE_PDL=True, **tiles), num_warps=cg.NUM_WARPS,
                            types=types, ints=ints)
    return compile_sm90(cg._norm_kernel, "bf16", dict(BLOCK_K=cg.BLOCK_K, INTERPRET=False, USE_PDL=True),
                        num_warps=cg.NUM_WARPS, types=types, ints=dict(D=4096))


def sync_cost(kernel: str):
    """`benchmarks/sync_cost.py`'s kernels (one warp a program): `edge`, `hop`, `barrier`."""
    from benchmarks import sync_cost as sc

    if kernel == "edge":
        return compile_sm90(sc._edge_kernel, "i32", dict(USE_PDL=True), num_warps=1)
    fn = sc._hop_kernel if kernel == "hop" else sc._barrier_kernel
    return compile_sm90(fn, "i32", {}, num_warps=1)


# name -> (what it is, how to compile it); "AR": one row (the AR step), "round": 16 rows
ROWS = {
    "gdn_verify 16-row BV32 BK64 w4 AR": ("the AR step's form with one_row off", lambda: verify(False)),
    "gdn_verify 16-row BV32 BK64 w4 round": ("the verification rounds' form", lambda: verify(False, rows=16)),
    "gdn_verify 16-row BV32 BK64 w8 round": ("8 warps", lambda: verify(False, num_warps=8, rows=16)),
    "gdn_verify 16-row BV32 BK32 w4 round": ("a narrower key chunk", lambda: verify(False, BK=32, rows=16)),
    "gdn_verify one-row BV32 BK64 w4 AR": ("the AR step's one-row form (VERIFY_CONFIG one_row, the default)", lambda: verify(True)),
    "gdn_verify_gated BK32 w8 AR": ("the one-row verify with the gated norm (VERIFY_CONFIG gated_one_row)",
                                    verify_gated),
    "gdn_verify_gated BK32 w4 AR": ("4 warps", lambda: verify_gated(num_warps=4)),
    "gdn_verify_gated BK64 w8 AR": ("a wider key chunk", lambda: verify_gated(BK=64)),
    "moe_gate_up default AR": ("the experts' gate/up at MoEKernelConfig's defaults", lambda: moe("gate_up")),
    "moe_gate_up default round": ("the same on 16 rows", lambda: moe("gate_up", rows=16)),
    "moe_gate_up gate_up_warps=8 AR": ("8 warps", lambda: moe("gate_up", gate_up_warps=8)),
    "moe_gate_up gate_up_block_h=128 AR": ("a narrower H step", lambda: moe("gate_up", gate_up_block_h=128)),
    "moe_gate_up gate_up_block_i=32 AR": ("a narrower I tile", lambda: moe("gate_up", gate_up_block_i=32)),
    "moe_gate_up gate_up_block_i=32,gate_up_block_h=128 AR": (
        "both", lambda: moe("gate_up", gate_up_block_i=32, gate_up_block_h=128)),
    "moe_down default AR": ("the experts' down at MoEKernelConfig's defaults", lambda: moe("down")),
    "moe_down default round": ("the same on 16 rows", lambda: moe("down", rows=16)),
    "moe_down down_block_h=128,down_warps=4 AR": ("wider H tile, 4 warps",
                                                  lambda: moe("down", down_block_h=128, down_warps=4)),
    "small_linear default AR": ("the GDN out projection, 4 K splits, at LinearKernelConfig's defaults",
                                small_linear),
    "small_linear num_stages=3 AR": ("one pipelined tile fewer", lambda: small_linear(num_stages=3)),
    "small_linear block_k=128 AR": ("a narrower K step", lambda: small_linear(block_k=128)),
    "chain_gemv persistent": ("chain_gemv.py: one program per SM ordered by counters, weights after the wait",
                              lambda: chain_gemv(prefetch=False)),
    "chain_gemv persistent prefetch": ("the first K step loaded before the wait", chain_gemv),
    "chain_gemv persistent norm": ("with the RMSNorm in the prologue", lambda: chain_gemv(norm=True, prefetch=False)),
    "chain_gemv persistent norm prefetch": ("both", lambda: chain_gemv(norm=True)),
    "chain_gemv launched gemv norm": ("one launch a layer, the norm in every program's prologue",
                                      lambda: chain_gemv("gemv")),
    "chain_gemv launched norm": ("the norm as a kernel of its own", lambda: chain_gemv("norm")),
    "sync_cost edge": ("sync_cost.py: the tiny kernel of a PDL edge", lambda: sync_cost("edge")),
    "sync_cost hop": ("a flag passed between SMs", lambda: sync_cost("hop")),
    "sync_cost barrier": ("a grid barrier", lambda: sync_cost("barrier")),
}


def main() -> None:
    import platform

    import triton

    from benchmarks.common import print_table, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="the rows whose name starts with this")
    parser.add_argument("--out", default="bench_out/kernel_resources")
    args = parser.parse_args()
    names = [n for n in ROWS if n.startswith(args.only)]
    if not names:
        raise SystemExit(f"--only {args.only!r} matches no row; the rows: {', '.join(ROWS)}")
    env = dict(triton=triton.__version__, target="sm90 (compiled, not run)", machine=platform.machine(),
               python=platform.python_version())
    print(env)
    print(f"acceptance: {ACCEPTANCE}")
    rows = []
    for name in names:
        what, build = ROWS[name]
        rows.append(dict(name=name, what=what, **resources(build())))
    print_table(["kernel", "registers", "spill stack B", "shared B", "tensor cores"],
                [[r["name"], r["registers"], r["spill_stack_bytes"], r["shared_bytes"] + r["static_shared_bytes"],
                  r["tensor_cores"]] for r in rows])
    write_json(Path(args.out) / "kernel_resources.json", dict(env=env, acceptance=ACCEPTANCE, rows=rows))


if __name__ == "__main__":
    main()
