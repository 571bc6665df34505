"""The MoE kernels compile for an sm90 GPU (the H200) with the installed Triton, on a machine
without one: the interpreter runs the kernels' Python, not Triton's compiler, so a construct the
interpreter accepts and the compiler refuses would otherwise first fail on the GPU. Compiled to
machine code (ptxas from Triton's wheel), never launched. The op tests under the interpreter check
what the kernels compute; this checks that the compiler takes them."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
nvidia = pytest.importorskip("triton.backends.nvidia")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hybridspec.ops import moe_triton  # noqa: E402
from hybridspec.ops.dispatch import TRITON_INTERPRET  # noqa: E402

pytestmark = pytest.mark.skipif(TRITON_INTERPRET, reason="under the interpreter the kernels are not JIT functions")

SM90 = GPUTarget("cuda", 90, 32)
# the 35B-A3B expert shape, one piece of 16 rows at top-8
SHAPE = dict(H=2048, I=512, K=8, BM=16, KP=8, SP=128)
INTEGER_POINTERS = ("ids_ptr", "num_tokens_ptr")


def compile_sm90(kernel, dtype: str, constexprs: dict, fp32_pointers=(), num_warps=4):
    """`kernel` compiled for sm90: pointers of `dtype` (int64 for ids and lengths, fp32 for
    `fp32_pointers`), other runtime arguments int32, `constexprs` by name."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INTEGER_POINTERS:
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in fp32_pointers else f"*{dtype}"
        else:
            signature[name] = "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=SM90, options={"num_warps": num_warps, "num_stages": 3})


# the runner's configuration (bf16, shared expert, pdl) and its opposites, in both dtypes
@pytest.mark.parametrize("dtype, shared, pdl", [("bf16", True, True), ("fp32", True, True), ("bf16", False, False),
                                                ("fp32", False, False)])
def test_moe_kernels_compile_for_sm90(dtype, shared, pdl):
    flags = dict(HAS_NUM_TOKENS=True, HAS_SHARED=shared, INTERPRET_BF16=False, USE_PDL=pdl)
    prec = dict(PRECISION="ieee" if dtype == "fp32" else "tf32")
    dims = {k: SHAPE[k] for k in ("H", "I", "K", "BM", "SP")}
    compile_sm90(moe_triton.moe_gate_up_kernel, dtype, {**SHAPE, **flags, **prec, "BN": 64, "BK": 256})
    compile_sm90(moe_triton.moe_down_kernel, dtype, {**dims, **flags, **prec, "BN": 64, "BK": 128},
                 fp32_pointers=("y_ptr",), num_warps=2)
    compile_sm90(moe_triton.moe_reduce_kernel, dtype, {"H": 2048, "K": 8, "BN": 1024, **flags},
                 fp32_pointers=("y_ptr",))
