"""`hybridspec::lm_head_top1`: custom op, fake kernel and host wrapper for a drafter's LM head when
only the top-1 token, its probability and the entropy are wanted.

Same form as the other ops (docs/design.md, "Ops"): the body launches the Triton kernels
(hybridspec/ops/lm_head_triton.py) for CUDA tensors, and for CPU tensors under
`TRITON_INTERPRET=1`, and runs the naive twin (hybridspec/ops/naive_lm_head.py) otherwise. Two
launches (per-tile partials, combine); the weight is read once per `block_m` rows and no `[N, V]`
tensor is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.ops import naive_lm_head
from hybridspec.ops.checks import FLOAT_INPUTS, check, dot_precision, next_pow2
from hybridspec.ops.dispatch import TRITON_INTERPRET, count_launch, pdl_launch, use_pdl, use_triton

_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass
class LMHeadKernelConfig:
    """Tiles of the partial kernel; `benchmarks/bench_kernels.py --sweep` tries other values.
    `block_m` caps the rows per program (all rows of a draft block, B x 15 <= 64, in one program,
    so the weight is read once); `block_v` vocabulary rows per program; `block_k` hidden columns
    per loop step."""

    block_m: int = 64
    block_v: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    # tiles merged per step of the combine kernel
    combine_tiles: int = 1024


KERNEL_CONFIG = LMHeadKernelConfig()


@torch.library.custom_op("hybridspec::lm_head_top1", mutates_args=(), device_types=None)
def _lm_head_top1_op(
    hidden: torch.Tensor, weight: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(hidden):
        return naive_lm_head.lm_head_top1(hidden, weight, scale)
    from hybridspec.ops.lm_head_triton import lm_head_combine_kernel, lm_head_partial_kernel

    cfg = KERNEL_CONFIG
    N, H = hidden.shape
    V = weight.shape[0]
    bm = min(max(16, next_pow2(N)), max(16, next_pow2(cfg.block_m)))
    bv = max(16, next_pow2(cfg.block_v))
    bk = min(max(16, next_pow2(cfg.block_k)), max(16, next_pow2(H)))
    if weight.element_size() == 4:
        # fp32 tiles of the default shape ask for 320 KB of shared memory over 3 stages (an H200
        # gives 227 KB): half the hidden columns per step fits
        bk = min(bk, 64)
    tiles = -(-V // bv)
    interp16 = TRITON_INTERPRET and weight.dtype != torch.float32
    rnd = _ROUND[weight.dtype]
    if TRITON_INTERPRET and rnd == 1:
        rnd = 3
    prec = dot_precision(weight)
    pdl = use_pdl(hidden)
    parts = [torch.empty(N, tiles, dtype=torch.float32, device=hidden.device) for _ in range(3)]
    idx = torch.empty(N, tiles, dtype=torch.int32, device=hidden.device)
    lm_head_partial_kernel[(tiles, -(-N // bm))](
        hidden, weight, parts[0], idx, parts[1], parts[2],
        N, V, scale,
        hidden.stride(0), weight.stride(0),
        H=H, BM=bm, BV=bv, BK=bk, HAS_SCALE=scale != 1.0, ROUND=rnd, UPCAST=interp16, PRECISION=prec,
        USE_PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )
    count_launch("lm_head_partial")
    tokens = torch.empty(N, dtype=torch.long, device=hidden.device)
    confidence = torch.empty(N, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty(N, dtype=torch.float32, device=hidden.device)
    lm_head_combine_kernel[(N,)](
        parts[0], idx, parts[1], parts[2], tokens, confidence, entropy,
        N, tiles, BT=min(next_pow2(tiles), max(16, next_pow2(cfg.combine_tiles))), USE_PDL=pdl, num_warps=4,
        **pdl_launch(pdl),
    )
    count_launch("lm_head_combine")
    return tokens, confidence, entropy


@_lm_head_top1_op.register_fake
def _(hidden, weight, scale):
    N = hidden.shape[0]
    return (hidden.new_empty(N, dtype=torch.long), hidden.new_empty(N, dtype=torch.float32),
            hidden.new_empty(N, dtype=torch.float32))


def lm_head_top1(
    hidden: torch.Tensor, weight: torch.Tensor, *, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of `hidden @ weight.T * scale`: the argmax token, its softmax probability and the
    softmax's entropy, without materialising the logits.

    `hidden` `[N, H]` (last dim contiguous), `weight` `[V, H]` (an LM head's, rows contiguous), one
    dtype (fp32, bf16 or fp16). The logits are those of `F.linear(hidden, weight) * scale` in that
    dtype: fp32 accumulation rounded to the dtype, then times `scale` and rounded again. Returns
    `tokens` int64 `[N]`, the first index of the maximum logit (`torch.argmax`'s choice, also among
    logits tied after rounding), `confidence` fp32 `[N]`, its probability under `softmax` taken in
    fp32, and `entropy` fp32 `[N]` in nats. Where the accumulation order of another matmul rounds a
    logit to a neighbouring value, a near-tie can go the other way (as between two GEMM libraries).
    One launch of the partial kernel reads the weight once for up to `KERNEL_CONFIG.block_m` rows.
    """
    check(hidden.dim() == 2 and hidden.shape[0] >= 1, f"hidden must be [N, H] with N >= 1, got {tuple(hidden.shape)}")
    N, H = hidden.shape
    check(weight.dim() == 2 and weight.shape[1] == H and weight.shape[0] >= 1,
          f"weight must be [V, H] = [V, {H}], got {tuple(weight.shape)}")
    check(hidden.dtype in FLOAT_INPUTS, f"hidden must be fp32, bf16 or fp16, got {hidden.dtype}")
    check(weight.dtype == hidden.dtype, f"weight ({weight.dtype}) must have hidden's dtype {hidden.dtype}")
    check(hidden.stride(1) == 1 and weight.stride(1) == 1,
          f"hidden and weight must be contiguous in their last dim, got strides {hidden.stride()} and {weight.stride()}")
    check(weight.shape[0] < 2**31, f"vocabulary of {weight.shape[0]} rows needs 64-bit token indices")
    check(weight.device == hidden.device, f"weight is on {weight.device}, hidden on {hidden.device}")
    return _lm_head_top1_op(hidden, weight, float(scale))
