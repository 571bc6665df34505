"""Our kernels compile for an sm90 GPU (the H200) with the installed Triton, on a machine
without one: the interpreter runs the kernels' Python, not Triton's compiler, so a construct the
interpreter accepts and the compiler refuses would otherwise first fail on the GPU. Compiled to
machine code (ptxas from Triton's wheel), never launched. The op tests under the interpreter check
what the kernels compute; this checks that the compiler takes them."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
nvidia = pytest.importorskip("triton.backends.nvidia")

# the compile helper `benchmarks/kernel_resources.py` reads registers and spills from
from benchmarks.kernel_resources import compile_sm90  # noqa: E402
from hybridspec.ops import moe_triton  # noqa: E402
from hybridspec.ops.dispatch import TRITON_INTERPRET  # noqa: E402

pytestmark = pytest.mark.skipif(TRITON_INTERPRET, reason="under the interpreter the kernels are not JIT functions")

# the 35B-A3B expert shape, one piece of 16 rows at top-8
SHAPE = dict(H=2048, I=512, K=8, BM=16, KP=8, SP=128)


# the runner's configuration (bf16, shared expert, pdl) and its opposites, in both dtypes; the
# batched round's 64-row piece (GATHER: routed rows gathered into 16-row tiles) in the runner's form
@pytest.mark.parametrize("dtype, shared, pdl, rows", [("bf16", True, True, 16), ("fp32", True, True, 16),
                                                      ("bf16", False, False, 16), ("fp32", False, False, 16),
                                                      ("bf16", True, True, 64), ("fp32", False, False, 64)])
def test_moe_kernels_compile_for_sm90(dtype, shared, pdl, rows):
    flags = dict(HAS_NUM_TOKENS=rows == 16, HAS_SHARED=shared, INTERPRET_BF16=False, USE_PDL=pdl)
    prec = dict(PRECISION="ieee" if dtype == "fp32" else "tf32")
    piece = {**SHAPE, "BM": rows, "SP": rows * SHAPE["K"], "RB": 16, "GATHER": rows > 16}
    dims = {k: piece[k] for k in ("H", "I", "K", "BM", "KP", "SP", "RB", "GATHER")}
    compile_sm90(moe_triton.moe_gate_up_kernel, dtype, {**piece, **flags, **prec, "BN": 64, "BK": 256,
                                                        "BK_WIDE": 128 if rows > 16 else 256,
                                                        "WRITE_ZEROS": rows > 16, "ZB": 256})
    compile_sm90(moe_triton.moe_down_kernel, dtype, {**dims, **flags, **prec, "BN": 64, "BK": 128, "WRITE_ALL": True},
                 fp32_pointers=("y_ptr",), num_warps=2)
    compile_sm90(moe_triton.moe_reduce_kernel, dtype, {"H": 2048, "K": 8, "BN": 1024, **flags},
                 fp32_pointers=("y_ptr",))


# every other kernel in the runner's form, programmatic dependent launch on (hybridspec/ops/pdl_triton.py)
def test_the_other_kernels_compile_for_sm90_with_pdl():
    from hybridspec.ops import (attention_triton, gdn_commit_triton, gdn_verify_gated_triton, gdn_verify_triton, linear_triton,
                                lm_head_triton, prologue_triton, route_triton)

    pdl = dict(USE_PDL=True)
    gdn = dict(HK=16, HV=32, K=128, V=128, BT=16, PRECISION="ieee", **pdl)
    lengths = {"len_ptr": "*i64", "start_ptr": "*i64"}
    kernels = [
        compile_sm90(linear_triton.small_linear_kernel, "bf16",
                     dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, PRECISION="tf32", UPCAST=False, INTERPRET_BF16=False, **pdl)),
        compile_sm90(route_triton.route_topk_kernel, "bf16", dict(EP=256, K=8, KP=8, NORMALIZE=True, INTERPRET_BF16=False, **pdl),
                     types={"ids_ptr": "*i64"}, num_warps=1),
        route_partials_sm90(),
        # past 16 the selection rounds loop instead of unrolling
        compile_sm90(route_triton.route_topk_kernel, "bf16", dict(EP=1024, K=1024, KP=1024, NORMALIZE=True,
                                                                  INTERPRET_BF16=False, **pdl),
                     types={"ids_ptr": "*i64"}, num_warps=2),
        compile_sm90(gdn_verify_triton.gdn_verify_kernel, "fp32", dict(gdn, BV=32, BK=64, HAS_NUM_TOKENS=True, USE_L2NORM=True,
                                                                       ONE_ROW=False),
                     types={"scale": "fp32"}),
        # the AR step's one-row form (T = 1)
        compile_sm90(gdn_verify_triton.gdn_verify_kernel, "fp32", dict(gdn, BV=32, BK=64, HAS_NUM_TOKENS=True, USE_L2NORM=True,
                                                                       ONE_ROW=True),
                     types={"scale": "fp32"}),
        compile_sm90(gdn_commit_triton.gdn_commit_kernel, "fp32", dict(gdn, BV=32), types={"num_commit_ptr": "*i64"}),
        # the AR step's verify with the gated norm (hybridspec/ops/gdn_gated.py), bf16 and fp32
        *(compile_sm90(gdn_verify_gated_triton.gdn_verify_gated_kernel, dtype,
                       dict(HK=16, HV=32, K=128, V=128, BK=32, HAS_NUM_TOKENS=True, USE_L2NORM=True,
                            ROUND_INPUT=dtype == "bf16", ROUND_PRODUCT=dtype == "bf16", **pdl),
                       fp32_pointers=("g_ptr", "beta_ptr", "state_ptr", "z_ptr", "kn_ptr", "gcum_ptr"),
                       types={"scale": "fp32", "eps": "fp32"}, num_warps=8) for dtype in ("bf16", "fp32")),
        compile_sm90(attention_triton.decode_attention_split_kernel, "bf16",
                     dict(W=16, G=8, HKV=2, D=256, DP=256, BM=16, BN=64, SPLITS=8, HAS_START=True, CAUSAL=True,
                          PRECISION="tf32", UPCAST=False, ROUND_BF16=False, **pdl),
                     fp32_pointers=("o_ptr", "lse_ptr"), types={**lengths, "scale_log2": "fp32"}),
        compile_sm90(attention_triton.decode_attention_combine_kernel, "bf16",
                     dict(W=16, G=8, HKV=2, D=256, DP=256, BN=64, SPLITS=8, CS=8, HAS_GATE=True, ROUND_BF16=False, **pdl),
                     fp32_pointers=("o_ptr", "lse_ptr"), types=lengths),
        # the attention layer's norms, rotary and KV write at the 35B-A3B shape (hybridspec/ops/prologue.py)
        *(compile_sm90(prologue_triton.attention_prologue_kernel, dtype,
                       dict(W=1, HQ=16, D=256, DP=256, R=64, INTERPRET_BF16=False, **pdl),
                       types={"len_ptr": "*i64", "eps": "fp32", "offset": "fp32"}, num_warps=2) for dtype in ("bf16", "fp32")),
        compile_sm90(lm_head_triton.lm_head_partial_kernel, "bf16",
                     dict(H=2048, BM=16, BV=128, BK=128, HAS_SCALE=False, ROUND=1, UPCAST=False, PRECISION="tf32", **pdl),
                     fp32_pointers=("max_ptr", "sum_ptr", "dot_ptr"), types={"idx_ptr": "*i32", "scale": "fp32"}),
        compile_sm90(lm_head_triton.lm_head_combine_kernel, "fp32", dict(BT=64, **pdl),
                     types={"idx_ptr": "*i32", "tok_ptr": "*i64"}),
    ]
    # each waits for the kernel before it and lets the next one launch
    for compiled in kernels:
        assert "griddepcontrol.wait" in compiled.asm["ptx"] and "griddepcontrol.launch_dependents" in compiled.asm["ptx"]


def route_partials_sm90():
    """The router's top-k on split-K partials in the runner's form: 4 splits, 256 experts, top-8."""
    from hybridspec.ops import route_triton

    return compile_sm90(route_triton.route_topk_partials_kernel, "bf16",
                        dict(S=4, EP=256, K=8, KP=8, BR=128, NORMALIZE=True, INTERPRET_BF16=False, USE_PDL=True),
                        fp32_pointers=("part_ptr",), types={"ids_ptr": "*i64"}, num_warps=1)


def test_route_partials_issue_every_load_before_the_selection():
    """The partials kernel's S splits (of the logits and of the first columns past them) are loaded
    in one unrolled pass before its first reduction: one round trip to L2, not one per split."""
    ptx = route_partials_sm90().asm["ptx"]
    first_reduction = ptx.index("shfl.sync")
    assert ptx[:first_reduction].count("ld.global") >= 2 * 4
    assert "bra" not in ptx[ptx.index("griddepcontrol.launch_dependents"):first_reduction]


# shared memory per block on an H200 (and any sm90): 227 KB
SM90_SMEM = 227 * 1024


@pytest.mark.parametrize("dtype, rows", [("fp32", 16), ("fp32", 64), ("bf16", 16), ("bf16", 64)])
def test_the_hosts_gate_up_tiles_fit_sm90_shared_memory(dtype, rows):
    """At the 35B-A3B expert shape the gate/up tiles the host picks (`gate_up_blocks`) compile within
    an sm90 block's shared memory: fp32's 256-wide H chunk asked for 288 KB and could not launch."""
    from hybridspec.ops.moe import KERNEL_CONFIG, gate_up_blocks

    bn, bk, bk_wide = gate_up_blocks(KERNEL_CONFIG, SHAPE["H"], SHAPE["I"], rows, 4 if dtype == "fp32" else 2)
    flags = dict(HAS_NUM_TOKENS=rows == 16, HAS_SHARED=True, INTERPRET_BF16=False, USE_PDL=True,
                 PRECISION="ieee" if dtype == "fp32" else "tf32")
    piece = {**SHAPE, "BM": rows, "SP": rows * SHAPE["K"], "RB": 16, "GATHER": rows > 16}
    kernel = compile_sm90(moe_triton.moe_gate_up_kernel, dtype, {**piece, **flags, "BN": bn, "BK": bk, "BK_WIDE": bk_wide,
                                                                 "WRITE_ZEROS": rows > 16, "ZB": 256})
    assert kernel.metadata.shared <= SM90_SMEM, (bn, bk, bk_wide, kernel.metadata.shared)
    # 16-bit tiles are the sweeps' choice, untouched; fp32 halves the H chunk
    assert (bk, bk_wide) == ((256, 128) if dtype == "bf16" else (128, 128))
