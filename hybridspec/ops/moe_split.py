"""`hybridspec::moe_experts_split_partials`: the MoE experts of a few rows in one launch, split over
the experts' width I, returning the partial sums that `moe_combine` adds in the consumer.

Why: the experts op's gate/up and down kernels are two dependent launches; at a decode step (one
row, or one per sequence of a small batch) the second waits for the first and each pays its own
ramp to the copy bandwidth. SwiGLU is elementwise along I, so one program per (expert, I slice)
computes its slice of the activation and the slice's contribution to the output with no
dependency between programs (hybridspec/ops/moe_split_triton.py). The price is the partials:
`[T, k (+1), splits, H]` fp32, written once and read by the consumer, which adds them in a fixed
order. `MoEKernelConfig.split_max_rows` says up to how many rows the compiled layers take it.

Same form as the other ops (docs/design.md, "Ops"): the Triton kernel for CUDA tensors and for CPU
tensors under `TRITON_INTERPRET=1`, the naive twin (`naive_moe.moe_experts_split_partials`)
otherwise; the wrapper validates, the kernel trusts its inputs. One launch, no host sync.
"""

from __future__ import annotations

import torch

from hybridspec.ops import naive_moe
from hybridspec.ops.checks import check, next_pow2
from hybridspec.ops.dispatch import TRITON_INTERPRET, count_launch, pdl_launch, use_triton
from hybridspec.ops.moe import BLOCK_ROWS, KERNEL_CONFIG, _block, _use_pdl, check_inputs, check_shared

# the kernel's bit mask of a row's assignments to one expert is an int32
MAX_TOP_K = 31


def default_splits(I: int) -> int:
    """Splits of I for `KERNEL_CONFIG.split_block_i` columns a program (the largest power of two
    up to it that divides I, 16 at least)."""
    return I // _block(KERNEL_CONFIG.split_block_i, I)


@torch.library.custom_op("hybridspec::moe_experts_split_partials", mutates_args=(), device_types=None)
def _moe_experts_split_partials_op(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    num_tokens: torch.Tensor | None,
    splits: int,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
) -> torch.Tensor:
    if not use_triton(hidden):
        return naive_moe.moe_experts_split_partials(hidden, topk_ids, gate_up_proj, down_proj, num_tokens, splits,
                                                    shared_gate_up, shared_down)
    from hybridspec.ops.moe_split_triton import moe_split_kernel

    cfg = KERNEL_CONFIG
    T, H = hidden.shape
    K = topk_ids.shape[1]
    E, I = gate_up_proj.shape[0], down_proj.shape[2]
    has_s = shared_gate_up is not None
    y = torch.empty(T, K + has_s, splits, H, dtype=torch.float32, device=hidden.device)
    if T == 0:
        return y
    ids = topk_ids.contiguous()  # read flat (a no-op for torch.topk's output)
    has_n = num_tokens is not None
    interp_bf16 = TRITON_INTERPRET and gate_up_proj.dtype == torch.bfloat16
    # fp32 operands need ieee (the default is tf32); 16-bit operands ignore the setting
    prec = "ieee" if gate_up_proj.dtype == torch.float32 or interp_bf16 else "tf32"
    pdl = _use_pdl(cfg, hidden)
    moe_split_kernel[(T * K + has_s, splits)](
        hidden, ids, num_tokens if has_n else ids, gate_up_proj, shared_gate_up if has_s else gate_up_proj,
        down_proj, shared_down if has_s else down_proj, y,
        T, E, hidden.stride(0),
        H=H, I=I, K=K, NB=splits, BM=BLOCK_ROWS, KP=next_pow2(K), SP=next_pow2(BLOCK_ROWS * K),
        BK=_block(cfg.gate_up_block_h, H), BH=_block(cfg.split_block_h, H),
        HAS_NUM_TOKENS=has_n, HAS_SHARED=has_s, PRECISION=prec, INTERPRET_BF16=interp_bf16, USE_PDL=pdl,
        num_warps=cfg.split_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )
    count_launch("moe_split")
    return y


@_moe_experts_split_partials_op.register_fake
def _(hidden, topk_ids, gate_up_proj, down_proj, num_tokens, splits, shared_gate_up=None, shared_down=None):
    return hidden.new_empty(hidden.shape[0], topk_ids.shape[1] + (shared_gate_up is not None), splits,
                            hidden.shape[1], dtype=torch.float32)


def moe_experts_split_partials(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    num_tokens: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """`moe_experts_partials` with each output split over I: `[T, k (+1), splits, H]` fp32, slot
    `[t, j, b]` expert `topk_ids[t, j]`'s output on row t from columns `[b * I / splits,
    (b + 1) * I / splits)` of its width (the SwiGLU output rounded to the weight dtype, as in
    `moe_experts`), so `y.sum(2)` is `moe_experts_partials`' `y` up to the order of fp32 sums;
    zeros where the assignment gives nothing. `moe_combine` takes the result as it is.

    Inputs as `moe_experts_partials`, with T <= 16 rows (one launch over every slot) and k <= 31.
    `splits`: divides I into slices of a power of two >= 16 columns; default `default_splits(I)`."""
    check_inputs(hidden, topk_ids, gate_up_proj, down_proj, num_tokens)
    T, K = topk_ids.shape
    I = down_proj.shape[2]
    check(T <= BLOCK_ROWS, f"moe_experts_split_partials takes at most {BLOCK_ROWS} rows, got {T}")
    check(K <= MAX_TOP_K, f"moe_experts_split_partials takes at most {MAX_TOP_K} assignments a row, got k = {K}")
    if splits is None:
        splits = default_splits(I)
    # the kernel's slice of I is a tl.arange: a power of two, 16 at least for tl.dot
    check(isinstance(splits, int) and splits >= 1 and I % splits == 0 and I // splits >= 16
          and (I // splits) & (I // splits - 1) == 0,
          f"splits must divide I = {I} into slices of a power of two >= 16 columns, got {splits!r}")
    if shared is None:
        return _moe_experts_split_partials_op(hidden, topk_ids, gate_up_proj, down_proj, num_tokens, splits)
    check(len(shared) == 2, f"shared must be (gate_up, down) here (the gate is moe_combine's), got {len(shared)} tensors")
    check_shared(hidden, down_proj, *shared)
    return _moe_experts_split_partials_op(hidden, topk_ids, gate_up_proj, down_proj, num_tokens, splits, *shared)
