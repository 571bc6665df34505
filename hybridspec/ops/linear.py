"""`hybridspec::small_linear`: custom op, fake kernel and host wrapper for `x @ weight.T` at a few
rows (M <= 64), a skinny GEMM that spreads the weight over ~N / block_n programs.

Same form as the other ops (docs/design.md, "Ops"): the body launches the Triton kernel
(hybridspec/ops/linear_triton.py) for CUDA tensors, and for CPU tensors under
`TRITON_INTERPRET=1`, and runs the naive twin (hybridspec/ops/naive_linear.py) otherwise. One
launch; deterministic (no atomics). `fits` tells a caller whether a call may take this op rather
than `F.linear`.

`hybridspec::small_linear_partials` is the same kernel with K split `splits` ways: one launch, fp32
partial sums `[splits, M, N]` that the caller adds (in a compiled region the add, the rounding and
whatever follows, a residual add and a norm, fuse into the consumer's kernel: split-K without a
second launch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.ops import naive_linear
from hybridspec.ops.naive_linear import split_span
from hybridspec.ops.checks import FLOAT_INPUTS, check, dot_precision, next_pow2
from hybridspec.ops.dispatch import TRITON_INTERPRET, count_launch, pdl_launch, use_pdl, use_triton

# one program holds every row: the row tile is at most 64
MAX_ROWS = 64
# splits of K `small_linear_partials` takes: each is a [M, N] fp32 slice its consumer reads
MAX_SPLITS = 16
# shared memory a launch may ask for: an H200 gives 227 KB per block, and Triton's layout
# conversions take some of it besides the pipelined tiles
SMEM_BUDGET = 192 * 1024


@dataclass
class LinearKernelConfig:
    """Tiles of `small_linear_kernel`; `benchmarks/bench_kernels.py --sweep` tries other values.
    `block_n` output features per program (N / block_n programs read the weight); `block_k` columns
    per loop step (halved for fp32, and shrunk until `num_stages` pipelined tiles fit in
    `SMEM_BUDGET`). The row tile is `max(16, next_pow2(M))`, not configurable; above 16 rows
    `wide_block_n` replaces `block_n`."""

    block_n: int = 16
    # block_n above 16 rows (a batched round's B x 16 rows): every program reads all M rows of x, so
    # at 64 rows and block_n 16 the programs read 4x the weight's bytes of x (from L2); a tile as
    # wide as the rows reads as much x as weight. Halved (down to block_n) while the grid would have
    # fewer than `min_programs` programs: the router's 257 outputs keep 16. On the H200 at B = 4,
    # the out projections 7.0 against 14.1 us (docs/benchmarks.md, "The batched round's tiles")
    wide_block_n: int = 64
    min_programs: int = 128
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    # K splits of the output projections (the mixers' and the drafter's,
    # `hybridspec.split_projection.split_out_projection`) through `small_linear_partials`; 1: their
    # modules (`F.linear`: cuBLAS, its own split-K and reduce kernel). 4: the H200's best of 1, 2, 4
    # and 8 (`benchmarks/bench_runner.py --ar-linear`; docs/benchmarks.md, "Split-K projections")
    out_split_k: int = 4
    # K splits of the MoE block's router GEMM (the router with the rows fused after it), whose
    # partials `route_topk_partials` adds (`hybridspec.patches.common.moe_verify`); 1: one
    # `small_linear` and `route_topk`. 4: as fast as 8 on the H200 and the best with out_split_k 4
    router_split_k: int = 4
    # K splits of the mixers' fused input projections (`hybridspec.split_projection.split_in_gemm`);
    # 1: `F.linear` (cuBLAS, or inductor's reduction at one row), which the H200 measured faster (AR step 3.090 ms against 3.233 at 2 and 3.420 at 4, one
    # process, with two since-removed experiments on in every row: docs/benchmarks.md, 2026-12-06)
    in_split_k: int = 1


KERNEL_CONFIG = LinearKernelConfig()


def _tiles(cfg: LinearKernelConfig, M: int, N: int, K: int, splits: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a call; tl.dot wants every side >= 16 and a power of two."""
    bm = min(MAX_ROWS, max(16, next_pow2(M)))
    narrow = max(16, next_pow2(cfg.block_n))
    bn = narrow
    if bm > 16:
        bn = max(narrow, next_pow2(cfg.wide_block_n))
        while bn > narrow and -(-N // bn) * splits < cfg.min_programs:
            bn //= 2
    bk = max(16, next_pow2(cfg.block_k))
    if element_size == 4:
        # fp32 tiles take twice the bytes: half the columns per step keep the stages' footprint
        bk = max(16, bk // 2)
    while bk > 16 and (bm + bn) * bk * element_size * max(1, cfg.num_stages) > SMEM_BUDGET:
        bk //= 2
    return bm, bn, min(bk, max(16, next_pow2(K)))


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, splits: int) -> None:
    """`small_linear_kernel` over `splits` splits of K into `out` (`[M, N]` in x's dtype for one
    split, `[splits, M, N]` fp32 partials otherwise)."""
    from hybridspec.ops.linear_triton import small_linear_kernel

    cfg = KERNEL_CONFIG
    M, K = x.shape
    N = weight.shape[0]
    bm, bn, bk = _tiles(cfg, M, N, K, splits, x.element_size())
    span = K
    if splits > 1:
        span = split_span(K, splits)
        # a K step never crosses a split: the span is a multiple of 16, so this stops at 16 at least
        while span % bk:
            bk //= 2
    interp16 = TRITON_INTERPRET and x.dtype != torch.float32
    pdl = use_pdl(x)
    small_linear_kernel[(-(-N // bn), -(-M // bm), splits)](
        x, weight, out,
        M, N, K, span,
        x.stride(0), weight.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PRECISION=dot_precision(x), UPCAST=interp16,
        INTERPRET_BF16=TRITON_INTERPRET and out.dtype == torch.bfloat16,
        USE_PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )


@torch.library.custom_op("hybridspec::small_linear", mutates_args=(), device_types=None)
def _small_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if not use_triton(x):
        return naive_linear.small_linear(x, weight)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, out, 1)
    count_launch("small_linear")
    return out


@_small_linear_op.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("hybridspec::small_linear_partials", mutates_args=(), device_types=None)
def _small_linear_partials_op(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    if not use_triton(x):
        return naive_linear.small_linear_partials(x, weight, splits)
    out = torch.empty(splits, x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    _launch(x, weight, out, splits)
    count_launch("small_linear_partials")
    return out


@_small_linear_partials_op.register_fake
def _(x, weight, splits):
    return x.new_empty(splits, x.shape[0], weight.shape[0], dtype=torch.float32)


def _last_dim_ok(t: torch.Tensor) -> bool:
    # one column is read at offset 0 whatever its stride
    return t.stride(1) == 1 or t.shape[1] == 1


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def fits(x2d: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `small_linear(x2d, weight)` accepts these inputs and would run the Triton kernel
    (CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1`); never raises. For a caller that
    picks between this op and `F.linear`. Inputs that would record a graph for backward do not
    fit: the op has no autograd formula. Nor do tensor subclasses (a DTensor shard, a quantized
    weight): the kernel reads plain strided memory."""
    return (
        type(x2d) in _PLAIN and type(weight) in _PLAIN
        and x2d.dim() == 2 and weight.dim() == 2
        and 1 <= x2d.shape[0] <= MAX_ROWS and x2d.shape[1] >= 1
        and weight.shape[0] >= 1 and weight.shape[1] == x2d.shape[1]
        and x2d.dtype in FLOAT_INPUTS and weight.dtype == x2d.dtype
        and weight.device == x2d.device and use_triton(x2d)
        and _last_dim_ok(x2d) and _last_dim_ok(weight)
        and not (torch.is_grad_enabled() and (x2d.requires_grad or weight.requires_grad))
    )


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` (`F.linear` without bias) for a few rows, in one launch whose programs each
    own `KERNEL_CONFIG.block_n` output features, so ~N / block_n programs stream the weight.

    `x` `[M, K]` with 1 <= M <= 64, `weight` `[N, K]` (rows may be a slice of a larger buffer: any
    row stride), both contiguous in their last dim, one dtype (fp32, bf16 or fp16), one device.
    Returns `[M, N]`, contiguous, in that dtype: fp32 accumulation rounded once, as the twin
    computes it. fp32 inputs multiply in 3xTF32 on the GPU (about fp32's precision). The order of
    summation is fixed (no split-K), so repeated calls give the same bits; it differs from cuBLAS's,
    so a result may differ from `F.linear`'s in the last bit.
    """
    _check_inputs(x, weight)
    return _small_linear_op(x, weight)


def small_linear_partials(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """`x @ weight.T` as `splits` fp32 partial sums over splits of K, in one launch: `[splits, M, N]`
    fp32, split s summing columns `[s * span, (s + 1) * span)` of K (`naive_linear.split_span`: about
    K / splits, a multiple of 16; the last splits may be short or zero). `out.sum(0).to(x.dtype)` is
    `small_linear(x, weight)` up to the order of the fp32 sum; in a compiled region that sum and
    what follows it fuse into one kernel. Inputs as `small_linear`; 1 <= splits <= 16.
    """
    _check_inputs(x, weight)
    check(isinstance(splits, int) and 1 <= splits <= MAX_SPLITS, f"splits must be an int in 1..{MAX_SPLITS}, got {splits!r}")
    return _small_linear_partials_op(x, weight, splits)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    """`small_linear`'s and `small_linear_partials`' input checks."""
    check(x.dim() == 2 and x.shape[0] >= 1 and x.shape[1] >= 1,
          f"x must be [M, K] with M >= 1 and K >= 1, got {tuple(x.shape)}")
    M, K = x.shape
    check(M <= MAX_ROWS, f"x [M, K] = {tuple(x.shape)}: at most {MAX_ROWS} rows")
    check(weight.dim() == 2 and weight.shape[0] >= 1 and weight.shape[1] == K,
          f"weight must be [N, K] = [N, {K}] with N >= 1, got {tuple(weight.shape)}")
    check(x.dtype in FLOAT_INPUTS, f"x must be fp32, bf16 or fp16, got {x.dtype}")
    check(weight.dtype == x.dtype, f"weight ({weight.dtype}) must have x's dtype {x.dtype}")
    check(_last_dim_ok(x) and _last_dim_ok(weight),
          f"x and weight must be contiguous in their last dim, got strides {x.stride()} and {weight.stride()}")
    check(weight.device == x.device, f"weight is on {weight.device}, x on {x.device}")
