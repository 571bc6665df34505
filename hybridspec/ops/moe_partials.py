"""`hybridspec::moe_experts_partials`: the MoE experts op without its reduce, and `moe_combine`,
the reduce in plain torch for the op's consumer.

Why: at a decode step the experts op's third launch, the weighted sum over a row's k + 1 expert
outputs, reads a few hundred KB and takes ~4 us a layer on an H200, mostly the launch itself. Its
result goes straight into the residual add after the block. Returned as the per-assignment outputs
`y` `[T, k (+1), H]` (fp32, every slot defined), the sum is a handful of pointwise terms that
inductor fuses into that residual add inside the compiled layer: the block's launches go from five
to four. The same idea as `small_linear_partials`, whose consumer adds the split-K partials.

`moe_experts_partials` runs the op's gate/up and down kernels (hybridspec/ops/moe_triton.py, the
down kernel with every slot written) for CUDA tensors and for CPU tensors under
`TRITON_INTERPRET=1`, else the naive twin (`naive_moe.moe_experts_partials`). `moe_combine` is the
reduce kernel's arithmetic written in torch: the routed terms added in the order j = 0..k-1 in
fp32, then the shared expert's gated output with the op's roundings. Eagerly those roundings are
the op's; inside a compiled region inductor keeps fused intermediates in fp32 unless
`emulate_precision_casts` is set, as it does everywhere in the compiled layers (16-bit roundings
there may differ in the last bit from eager; fp32 models compute the same sums).
"""

from __future__ import annotations

import torch

from hybridspec.ops import naive_moe
from hybridspec.ops.checks import FLOAT_INPUTS, check, is_integer
from hybridspec.ops.dispatch import count_launch, use_triton
from hybridspec.ops.moe import check_inputs, check_shared, launch_pieces


@torch.library.custom_op("hybridspec::moe_experts_partials", mutates_args=(), device_types=None)
def _moe_experts_partials_op(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    num_tokens: torch.Tensor | None,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
) -> torch.Tensor:
    if not use_triton(hidden):
        return naive_moe.moe_experts_partials(hidden, topk_ids, gate_up_proj, down_proj, num_tokens,
                                              shared_gate_up, shared_down)
    T, H = hidden.shape
    has_s = int(shared_gate_up is not None)
    y = torch.empty(T, topk_ids.shape[1] + has_s, H, dtype=torch.float32, device=hidden.device)
    if T == 0:
        return y
    # the kernels read ids flat (a no-op for torch.topk's output)
    launch_pieces(hidden, topk_ids.contiguous(), None, gate_up_proj, down_proj, num_tokens,
                  (shared_gate_up, shared_down, None) if has_s else None, y, None)
    count_launch("moe_experts_partials")
    return y


@_moe_experts_partials_op.register_fake
def _(hidden, topk_ids, gate_up_proj, down_proj, num_tokens, shared_gate_up=None, shared_down=None):
    # an int, not a bool: under dynamic shapes k is a SymInt, and SymInt + bool fails in sympy on
    # torch 2.11 (opcheck's test_aot_dispatch_dynamic on the H200 caught it; 2.13 accepts it)
    return hidden.new_empty(hidden.shape[0], topk_ids.shape[1] + int(shared_gate_up is not None), hidden.shape[1],
                            dtype=torch.float32)


def moe_experts_partials(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    num_tokens: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`moe_experts` before its weighted sum: `[T, k (+1), H]` fp32, slot `[t, j]` the output of
    expert `topk_ids[t, j]` on row t (unweighted; the SwiGLU output rounded to the weight dtype, as
    in `moe_experts`), zeros where the assignment gives nothing (rows at or past `num_tokens`, ids
    outside `[0, E)`). `shared` `(gate_up [2I, H], down [H, I])`: the shared expert's output in the
    last slot (zero past `num_tokens`). Inputs as `moe_experts`; two launches per piece of up to 64
    rows. `moe_combine` turns the result into `moe_experts`' output."""
    check_inputs(hidden, topk_ids, gate_up_proj, down_proj, num_tokens)
    if shared is None:
        return _moe_experts_partials_op(hidden, topk_ids, gate_up_proj, down_proj, num_tokens)
    check(len(shared) == 2, f"shared must be (gate_up, down) here (the gate is moe_combine's), got {len(shared)} tensors")
    check_shared(hidden, down_proj, *shared)
    return _moe_experts_partials_op(hidden, topk_ids, gate_up_proj, down_proj, num_tokens, *shared)


def moe_combine(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    dtype: torch.dtype,
    *,
    num_tokens: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """`moe_experts`' result from `moe_experts_partials`' `y`: `sum_j w[t, j] * y[t, j]` over the
    valid assignments in the order j = 0..k-1 in fp32 (the reduce kernel's order), in `dtype`; with
    `shared_gate` (logits `[T]` or `[T, 1]`, `y` then holding the shared expert's output in its last
    slot) `round(round(routed) + round(round(sigmoid(gate)) * round(shared)))`; rows at or past
    `num_tokens` are zero. Weights and gates of invalid assignments and rows may be NaN: they are
    selected away (`where`), never multiplied by zero. Plain torch, for a compiled consumer to fuse."""
    check(y.dim() == 3 and y.dtype == torch.float32, f"y must be moe_experts_partials' [T, k (+1), H] fp32, got "
          f"{y.dtype} {tuple(y.shape)}")
    T, KY, H = y.shape
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == T and is_integer(topk_ids),
          f"topk_ids must be an integer [T, k] with T = {T}, got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    K = topk_ids.shape[1]
    check(KY == K + (shared_gate is not None),
          f"y has {KY} slots a row: k = {K} routed{' and the shared one' if shared_gate is not None else ''} "
          f"make {K + (shared_gate is not None)}")
    check(topk_weights.shape == (T, K) and topk_weights.is_floating_point(),
          f"topk_weights must be a float [T, k] = [{T}, {K}], got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    check(dtype in FLOAT_INPUTS, f"dtype must be fp32, bf16 or fp16, got {dtype}")
    ok = (topk_ids >= 0) & (topk_ids < num_experts)  # [T, k]
    rows_ok = None
    if num_tokens is not None:
        rows_ok = torch.arange(T, device=y.device) < num_tokens.reshape(())
        ok = ok & rows_ok[:, None]
    w = topk_weights.float()
    routed = torch.where(ok[:, 0, None], w[:, 0, None] * y[:, 0], 0.0)
    for j in range(1, K):
        routed = routed + torch.where(ok[:, j, None], w[:, j, None] * y[:, j], 0.0)
    if shared_gate is None:
        return routed.to(dtype)
    check(shared_gate.shape in ((T,), (T, 1)), f"shared_gate must be [T] or [T, 1] with T = {T}, got {tuple(shared_gate.shape)}")
    shared = y[:, K].to(dtype).float()
    gate = torch.sigmoid(shared_gate.reshape(T, 1).float()).to(dtype).float()
    both = routed.to(dtype).float() + (gate * shared).to(dtype).float()
    if rows_ok is not None:
        both = torch.where(rows_ok[:, None], both, 0.0)
    return both.to(dtype)
