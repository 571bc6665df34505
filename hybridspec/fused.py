"""Linears that read one input, run as one GEMM: the model's weights stored once, fused.

A decode step multiplies one or a few rows by every projection of a layer. Each projection is a
launch that reads its weight and waits on the last one, so a GDN mixer's four input projections
(qkv, z, b, a: two of them 32 rows wide) cost four launches for one read of the input; a fused
weight, their rows stacked, costs one. The verification forward fuses:

- GDN: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (Qwen3.5/3.6) or `in_proj_qkvz`,
  `in_proj_ba` (Qwen3-Next);
- attention: `q_proj`, `k_proj`, `v_proj`;
- sparse MoE: the router, the block's `shared_expert_gate`, and the shared expert's `gate_proj`
  and `up_proj` (whose rows the experts op reads as one more expert's `[2I, H]` weight).

Stored once: `fuse` stacks the weights into one tensor, a non-persistent buffer of the parent
module (it moves with `model.to` and stays out of `state_dict`), and makes each linear's `weight`
a view of its rows, so the model's memory does not grow. The rule for changing weights after
hybridspec has run (docs/design.md, "Fused projections"): in-place changes (`load_state_dict`,
`param.copy_`, an optimizer step) reach the fused weight through the views; a parameter replaced
by another tensor (`module.weight = nn.Parameter(...)`, `model.to(dtype)`) is not a view any more,
and `refresh`, which every `generate(..., hybridspec=True)` call runs, copies it back into the fused
weight. `unfuse` (run by `hybridspec.disable`) gives every linear a weight of its own again.

Left as separate GEMMs: linears with a bias, of different dtypes or devices, not plain
`nn.Linear`, or sharded by tensor parallelism (`hybridspec.parallel` multiplies each shard).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec import parallel

PREFIX = "_hybridspec_fused_"
# fused weights end on a multiple of this many rows (zero rows after the last linear's): the GEMM's
# output rows then start on 16-byte boundaries, which cuBLAS's fast kernels ask of their operands
ROW_ALIGN = 16


def _padded(rows: int) -> int:
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


def plain_linear(lin: nn.Module) -> bool:
    """A bias-free `nn.Linear` itself (not a subclass or a wrapper such as a LoRA adapter) without
    forward hooks: what it computes is `F.linear(x, weight)`, so a caller may run that instead."""
    return type(lin) is nn.Linear and lin.bias is None and not lin._forward_hooks and not lin._forward_pre_hooks


def plain_unsharded(linear) -> bool:
    """A plain bias-free `nn.Linear` without hooks or an instance-level `forward` (transformers'
    tensor-parallel styles and accelerate's hooks install one), its weight not sharded."""
    return plain_linear(linear) and "forward" not in vars(linear) and not isinstance(linear.weight, parallel.DTensor)


def _fusable(linears: Sequence[nn.Module], linear_like: tuple = ()) -> bool:
    """Plain bias-free `nn.Linear`s without forward hooks (a hook, or a wrapper such as a LoRA
    adapter in the module's place, changes what the module computes), or modules of `linear_like`
    types, which the caller knows to compute `F.linear(x, weight)` and calls without their hooks
    anyway (the MoE router: transformers hooks it to record router logits); of one dtype, device
    and input width, none sharded."""
    first = linears[0].weight
    return isinstance(first, nn.Parameter) and all(
        (plain_linear(lin) or type(lin) in linear_like)
        and isinstance(lin.weight, nn.Parameter) and not isinstance(lin.weight, parallel.DTensor)
        and lin.weight.dim() == 2 and lin.weight.dtype == first.dtype and lin.weight.device == first.device
        and lin.weight.shape[1] == first.shape[1] and lin.weight.device.type != "meta"
        for lin in linears
    )


def _own(w: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
    """`w` detached, cloned where it lives in `stacked` (a weight moved within the group must not be
    read from rows that the copy overwrites)."""
    w = w.detach()
    return w.clone() if w.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr() else w


def _stack(linears: Sequence[nn.Module]) -> torch.Tensor:
    weights = [lin.weight.detach() for lin in linears]
    rows = sum(w.shape[0] for w in weights)
    pad = weights[0].new_zeros(_padded(rows) - rows, weights[0].shape[1])
    return torch.cat([*weights, pad])


def fuse(parent: nn.Module, name: str, linears: Sequence[nn.Module], linear_like: tuple = ()) -> bool:
    """Stack `linears`' weights into the buffer `parent.<PREFIX><name>` and make each weight a view
    of its rows; idempotent (an existing fusion is refreshed). False where they cannot be fused.
    `linear_like`: module types besides `nn.Linear` that compute `F.linear(x, weight)` (a router)."""
    buffer = PREFIX + name
    if buffer in parent._buffers:
        return refresh(parent, name, linears, linear_like)
    if not _fusable(linears, linear_like):
        return False
    # outside inference mode, which would turn the model's own parameters into inference tensors (no
    # in-place updates or autograd afterwards; calibration runs the runner under inference_mode)
    with torch.inference_mode(False), torch.no_grad():
        stacked = _stack(linears)
        parent.register_buffer(buffer, stacked, persistent=False)
        _link(stacked, linears)
    return True


def _link(stacked: torch.Tensor, linears: Sequence[nn.Module]) -> None:
    # `.data`, not a new Parameter: the Parameter objects stay the model's (an optimizer made
    # before, weight ties and `.grad` keep referring to them); only their storage moves
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = stacked[offset : offset + rows]
        offset += rows


def _linked(stacked: torch.Tensor, linears: Sequence[nn.Module]) -> bool:
    offset, row_bytes = 0, stacked.stride(0) * stacked.element_size()
    for lin in linears:
        w = lin.weight
        if (w.dtype != stacked.dtype or w.device != stacked.device or w.shape[1] != stacked.shape[1]
                or w.data_ptr() != stacked.data_ptr() + offset * row_bytes or not w.is_contiguous()):
            return False
        offset += w.shape[0]
    return _padded(offset) == stacked.shape[0]


def refresh(parent: nn.Module, name: str, linears: Sequence[nn.Module], linear_like: tuple = ()) -> bool:
    """Re-establish the views after a weight was replaced: copy the linears' weights into the fused
    buffer in place (its address stays, as captured graphs need) where its shape, dtype and device
    still fit, else stack them into a new buffer. A group that can no longer be fused (a module
    swapped for a wrapper, a hook added, a bias, a shard) is unfused. Returns whether it is fused."""
    buffer = PREFIX + name
    stacked = parent._buffers[buffer]
    if not _fusable(linears, linear_like):
        unfuse_group(parent, name, linears)
        return False
    if _linked(stacked, linears):
        return True
    with torch.inference_mode(False), torch.no_grad():
        rows = sum(lin.weight.shape[0] for lin in linears)
        fits = all(lin.weight.dtype == stacked.dtype and lin.weight.device == stacked.device
                   and lin.weight.shape[1] == stacked.shape[1] for lin in linears) and _padded(rows) == stacked.shape[0]
        if fits:
            weights = [_own(lin.weight, stacked) for lin in linears]
            offset = 0
            for w in weights:
                stacked[offset : offset + w.shape[0]].copy_(w)
                offset += w.shape[0]
        else:
            stacked = _stack(linears)
            parent._buffers[buffer] = stacked
        _link(stacked, linears)
    return True


def unfuse_group(parent: nn.Module, name: str, linears: Sequence[nn.Module]) -> None:
    """Give each linear its own weight again (a copy of its rows, where it still lives in the fused
    buffer) and drop the fused buffer."""
    stacked = parent._buffers.pop(PREFIX + name, None)
    if stacked is None:
        return
    with torch.inference_mode(False), torch.no_grad():
        # every parameter still in the buffer (a wrapper put in a linear's place holds it inside)
        for lin in linears:
            for w in lin.parameters():
                if w.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr():
                    w.data = w.detach().clone()


def fused_weight(parent: nn.Module, name: str) -> torch.Tensor | None:
    """The fused weight of `parent`'s group `name`, or None where it is not fused."""
    # attribute access (module buffers are attributes) is what dynamo traces as a graph input
    return getattr(parent, PREFIX + name, None)


def fused_rows(parent: nn.Module, name: str, linears: Sequence[nn.Module], skip: int = 0,
               take: int | None = None) -> tuple[torch.Tensor, list[int]] | None:
    """The rows of the fused weight that `project` multiplies for `linears[skip:]` (or
    `linears[skip:skip + take]`), and the output sizes it splits them into: each chosen linear's,
    then the padding rows' (see `project`). None where the group is not fused."""
    stacked = fused_weight(parent, name)
    if stacked is None:
        return None
    first = sum(lin.weight.shape[0] for lin in linears[:skip])
    chosen = linears[skip:] if take is None else linears[skip : skip + take]
    sizes = [lin.weight.shape[0] for lin in chosen]
    end = stacked.shape[0] if take is None else min(stacked.shape[0], first + _padded(sum(sizes)))
    return stacked[first:end], [*sizes, end - first - sum(sizes)]


def project(parent: nn.Module, name: str, linears: Sequence[nn.Module], x: torch.Tensor,
            skip: int = 0, gemm=F.linear, take: int | None = None) -> list[torch.Tensor] | None:
    """The outputs of `linears[skip:]` (or `linears[skip:skip + take]`) on `x` as one GEMM
    (`gemm(x, weight)`) over their rows of the fused weight (to its end, or with `take` over their
    row count rounded up to a multiple of `ROW_ALIGN`, within the buffer: the extra rows are
    computed and split off); None where the group is not
    fused (the caller runs its linears as they are)."""
    rows = fused_rows(parent, name, linears, skip, take)
    if rows is None:
        return None
    weight, sizes = rows
    return list(gemm(x, weight).split(sizes, dim=-1)[:-1])
