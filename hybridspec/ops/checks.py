"""What the ops' validating wrappers and launch plans share: the accepted float dtypes, the check
that raises `ValueError`, the integer-tensor test, the power-of-two rounding of tile sizes and the
precision of `tl.dot`."""

from __future__ import annotations

import torch

from hybridspec.ops.dispatch import TRITON_INTERPRET

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
# fp32 `tl.dot` on the GPU: plain TF32 misses the 1e-5 tests, `ieee` spills registers at K = 128
GPU_DOT_PRECISION = "tf32x3"


def dot_precision(t: torch.Tensor) -> str:
    """`tl.dot`'s input precision for operands of `t`'s dtype and device: fp32 in 3xTF32 on the GPU;
    `ieee` under the interpreter (where 16-bit operands are upcast to fp32 first); 16-bit operands
    on the GPU ignore it."""
    if t.dtype == torch.float32:
        return GPU_DOT_PRECISION if t.is_cuda and not TRITON_INTERPRET else "ieee"
    return "ieee" if TRITON_INTERPRET else "tf32"


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def is_integer(t: torch.Tensor) -> bool:
    """An integer dtype, bool excluded (lengths, counts, expert ids)."""
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def check_lengths(name: str, t: torch.Tensor | None, B: int, device: torch.device, one_for_all: bool = False) -> None:
    """`t` (if given) is an integer `[B]` tensor on `device`; with `one_for_all` a `[1]` tensor (one
    value for every batch row) passes too."""
    if t is None:
        return
    shapes = ((B,), (1,)) if one_for_all else ((B,),)
    check(tuple(t.shape) in shapes and is_integer(t),
          f"{name} must be an integer tensor of shape [B] = [{B}]{' or [1]' if one_for_all else ''}, got {t.dtype} "
          f"{tuple(t.shape)}")
    check(t.device == device, f"{name} is on {t.device}, the inputs on {device}")
