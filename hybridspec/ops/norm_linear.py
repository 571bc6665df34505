"""`hybridspec::gated_norm_linear_partials`: a GDN mixer's gated RMSNorm and its output projection
in one launch, as split-K partial sums.

A GDN mixer ends with `out_proj(norm(o, z))`, `norm` transformers' `RMSNormGated` over each value
head of `o` (`head_v_dim` columns) gated by silu(z). Compiled, that norm was two inductor kernels
(the variance, then its apply) between the verify kernel and the output projection at every GDN
layer. Because each head is normalised on its own, `small_linear_partials`' programs can apply it
to the columns of x they load, when their K steps hold whole heads: the op is that kernel with the
norm as its prologue (hybridspec/ops/linear_triton.py), and the norm costs no launch. The gate
comes in activated (`act = silu(z.float())`, which the caller's compiled layer computes where it
already reads z): every program of a split recomputes its heads' norms, so the prologue keeps to
multiplies, an rsqrt per row and head, and roundings.

Same form as the other ops (docs/design.md, "Ops"): the Triton kernel for CUDA tensors and for CPU
tensors under `TRITON_INTERPRET=1`, the naive twin (`naive_linear.gated_norm_linear_partials`)
otherwise; `fits_gated` tells a caller whether a call may take it (never raises).
"""

from __future__ import annotations

import torch

from hybridspec.ops import naive_linear
from hybridspec.ops.checks import check
from hybridspec.ops.dispatch import count_launch, use_triton
from hybridspec.ops.linear import MAX_SPLITS, _check_inputs, _launch, fits
from hybridspec.ops.naive_linear import split_span

# the norm's group must be a power of two the kernel's K step can hold whole (with x's tile and the
# gate's, in the shared memory of one stage at 64 rows)
MIN_GROUP, MAX_GROUP = 16, 256


@torch.library.custom_op("hybridspec::gated_norm_linear_partials", mutates_args=(), device_types=None)
def _gated_norm_linear_partials_op(x: torch.Tensor, act: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                                   splits: int, eps: float) -> torch.Tensor:
    if not use_triton(x):
        return naive_linear.gated_norm_linear_partials(x, act, norm_weight, weight, splits, eps)
    out = torch.empty(splits, x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    _launch(x, weight, out, splits, gated=(act, norm_weight, eps))
    count_launch("gated_norm_linear_partials")
    return out


@_gated_norm_linear_partials_op.register_fake
def _(x, act, norm_weight, weight, splits, eps):
    return x.new_empty(splits, x.shape[0], weight.shape[0], dtype=torch.float32)


def _group_ok(K: int, G: int, splits: int) -> bool:
    """Every split of K (`split_span`) holds whole groups of G columns."""
    return (MIN_GROUP <= G <= MAX_GROUP and G & (G - 1) == 0 and K % G == 0
            and (splits == 1 or split_span(K, splits) % G == 0))


def fits_gated(x2d: torch.Tensor, act: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
               splits: int, eps: float) -> bool:
    """Whether `gated_norm_linear_partials` accepts these inputs and would run the Triton kernel
    (`fits` for x and the weight, an fp32 activated gate shaped like x, a norm weight of x's dtype
    whose group every split holds whole, eps > 0); never raises."""
    return (
        fits(x2d, weight) and 1 <= splits <= MAX_SPLITS and eps > 0
        and type(act) is torch.Tensor and act.shape == x2d.shape and act.dtype == torch.float32
        and act.device == x2d.device and act.stride(-1) == 1
        and type(norm_weight) in (torch.Tensor, torch.nn.Parameter) and norm_weight.dim() == 1
        and norm_weight.dtype == x2d.dtype and norm_weight.device == x2d.device and norm_weight.is_contiguous()
        and _group_ok(x2d.shape[1], norm_weight.shape[0], splits)
        and not (torch.is_grad_enabled() and (act.requires_grad or norm_weight.requires_grad))
    )


def gated_norm_linear_partials(x: torch.Tensor, act: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                               splits: int, *, eps: float) -> torch.Tensor:
    """`small_linear_partials(norm(x, gate), weight, splits)`, `norm` transformers' `RMSNormGated`
    with weight `norm_weight` `[G]` and `eps` over each group of G columns of `x` `[M, K]`, given its
    gate activated: `act = silu(gate.float())` (`naive_linear.gated_rmsnorm`: the module's roundings
    included), in one launch.

    `act` fp32 `[M, K]` (any row stride, contiguous in its last dim), `norm_weight` contiguous in
    x's dtype, G a power of two in 16..256 dividing K and each split's span (`split_span`), eps > 0
    (a masked group normalises zeros); x and `weight` as `small_linear_partials` takes them.
    Returns `[splits, M, N]` fp32 partial sums.
    """
    _check_inputs(x, weight)
    M, K = x.shape
    check(isinstance(splits, int) and 1 <= splits <= MAX_SPLITS, f"splits must be an int in 1..{MAX_SPLITS}, got {splits!r}")
    check(act.shape == x.shape and act.dtype == torch.float32 and act.device == x.device,
          f"act must be fp32 shaped like x ({tuple(x.shape)} on {x.device}), got {act.dtype} {tuple(act.shape)} on {act.device}")
    check(act.stride(-1) == 1, f"act must be contiguous in its last dim, got strides {act.stride()}")
    check(norm_weight.dim() == 1 and norm_weight.dtype == x.dtype and norm_weight.device == x.device
          and norm_weight.is_contiguous(),
          f"norm_weight must be a contiguous [G] tensor of x's dtype {x.dtype} on {x.device}, got {norm_weight.dtype} "
          f"{tuple(norm_weight.shape)} on {norm_weight.device}")
    G = norm_weight.shape[0]
    check(_group_ok(K, G, splits),
          f"the norm's group ({G}) must be a power of two in {MIN_GROUP}..{MAX_GROUP} dividing K ({K}) and each of "
          f"{splits} splits' span ({split_span(K, splits)})")
    check(eps > 0, f"eps must be > 0, got {eps}")
    return _gated_norm_linear_partials_op(x, act, norm_weight, weight, splits, float(eps))
