"""`hybridspec::moe_experts`: custom op, fake kernel and host wrapper for small-batch MoE experts.

Same form as the GDN ops (docs/design.md, "Ops"): a `torch.library.custom_op` whose body launches the
Triton kernels (hybridspec/ops/moe_triton.py) for CUDA tensors, and for CPU tensors under
`TRITON_INTERPRET=1`, and runs the naive twin otherwise. The wrapper validates; the kernels trust
their inputs. Three launches per piece of up to 64 rows (gate/up, down, reduce), no host sync, no
data-dependent shapes. With `KERNEL_CONFIG.pdl` on an sm90+ GPU all three use programmatic
dependent launch (hybridspec/ops/pdl_triton.py): each is launched while the kernel before it runs
and waits inside for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.ops import naive_moe
from hybridspec.ops.checks import FLOAT_INPUTS, check, is_integer, next_pow2
from hybridspec.ops.dispatch import TRITON_INTERPRET, count_launch, pdl_launch, use_pdl, use_triton

# token rows per kernel piece: tl.dot needs at least 16, and 16 covers a verification window;
# a batch of verification windows (B x 16 rows, B <= 4) runs as one piece of up to 64 rows, so
# each expert of the union over the batch is read once
BLOCK_ROWS = 16
MAX_PIECE_ROWS = 64
# the gate/up kernel's H chunk for the shared expert's tile above 16 rows (the routed experts'
# rows are gathered into 16-row tiles there). Chosen when every expert took the 64-row tile, which
# at 256 was estimated at 288 KB of shared memory (the H200 has 227 KB); an sm90 compile of today's
# bf16 shared tile takes 96 KB at 256 and 48 KB at 128, but only 128 has been timed on the GPU
WIDE_PIECE_BLOCK_H = 128
# shared memory the gate/up kernel's pipelined fp32 tiles may take: Triton holds (num_stages - 1)
# copies of the x and both weight tiles there (its sm90 compiles match that count), and the H200
# gives 227 KB per block; at H = 2048 fp32 the 256-wide chunk asked for 288 KB and could not launch
FP32_SMEM_BUDGET = 192 * 1024


@dataclass
class MoEKernelConfig:
    """Tile sizes and launch options; `benchmarks/bench_moe.py --sweep` tries other values.

    The defaults are the sweep's best on an H200 at the 35B-A3B shape (docs/benchmarks.md).

    Each block size is an upper bound: the launch uses the largest power of two <= it that divides
    the dimension it tiles (H and I are multiples of 16), so weight loads are never masked.
    """

    # I columns per gate/up program: narrow tiles put more programs in flight at small U
    gate_up_block_i: int = 64
    # H chunk per loop step of gate/up
    gate_up_block_h: int = 256
    gate_up_warps: int = 4
    # H columns per down program, and I chunk per loop step of down
    down_block_h: int = 64
    down_block_i: int = 128
    # down's I chunk in a gathered piece (over 16 rows: a batch's B x w rows, experts' rows in 16-row
    # tiles): on the H200 at B = 4 down took 27.5 against 34.0 us and the MoE part of a round 2-3%
    # less at every w (docs/benchmarks.md, "Batched rounds: wider tiles"); 16-row pieces keep
    # `down_block_i`, the sweep's best at B = 1
    down_block_i_gather: int = 64
    down_warps: int = 2
    # software-pipelined weight loads in flight per program (both weight kernels)
    num_stages: int = 3
    reduce_block_h: int = 1024
    # inside a compiled layer, the MoE block's weighted sum over its experts as plain torch that
    # inductor fuses into the residual add after the block (`moe_experts_partials` + `moe_combine`,
    # hybridspec/ops/moe_partials.py) instead of the reduce kernel: one launch a layer fewer. On
    # the H200 the AR step 2.954 against 3.033 ms and C(16) 1.29x its bound, and the captured
    # runner's GPU tests pass with it (docs/benchmarks.md, "The MoE reduce in the consumer")
    combine_in_consumer: bool = True
    # programmatic dependent launch of the three kernels: each starts while the kernel before it runs
    # (down and reduce alone: 1.4-2 us less per call on an H200). Needs sm90+ CUDA and
    # `dispatch.PDL`; ignored on older GPUs and under the interpreter
    pdl: bool = True


KERNEL_CONFIG = MoEKernelConfig()


def _block(limit: int, dim: int) -> int:
    b = 16
    while b * 2 <= limit and dim % (b * 2) == 0:
        b *= 2
    return b


def gate_up_blocks(cfg: MoEKernelConfig, H: int, I: int, BM: int, element_size: int) -> tuple[int, int, int]:
    """(BN, BK, BK_WIDE) of the gate/up kernel for a piece of BM rows: the routed experts' tile has
    `min(BM, 16)` rows (gathered past 16), the shared expert's in a wider piece BM rows with the
    narrower `WIDE_PIECE_BLOCK_H` chunk. For fp32 each chunk is halved while its tiles would pass
    `FP32_SMEM_BUDGET`; 16-bit tiles are left as the sweeps chose them."""
    bn = _block(cfg.gate_up_block_i, I)
    bk = _block(cfg.gate_up_block_h, H)
    bk_wide = _block(min(cfg.gate_up_block_h, WIDE_PIECE_BLOCK_H), H)

    def fits(rows, chunk):
        return element_size < 4 or (cfg.num_stages - 1) * (rows + 2 * bn) * chunk * element_size <= FP32_SMEM_BUDGET

    while bk > 16 and not fits(min(BM, BLOCK_ROWS), bk):
        bk //= 2
    while bk_wide > 16 and not fits(BM, bk_wide):
        bk_wide //= 2
    return bn, bk, bk_wide


def down_blocks(cfg: MoEKernelConfig, H: int, I: int, BM: int) -> tuple[int, int]:
    """(BN, BK) of the down kernel for a piece of BM rows: `down_block_i_gather` past 16 rows."""
    chunk = cfg.down_block_i_gather if BM > BLOCK_ROWS else cfg.down_block_i
    return _block(cfg.down_block_h, H), _block(chunk, I)


def _use_pdl(cfg: MoEKernelConfig, x: torch.Tensor) -> bool:
    """Whether this call uses programmatic dependent launch: asked for here and by
    `dispatch.use_pdl` (on, an sm90+ GPU, not interpreted)."""
    return bool(cfg.pdl) and use_pdl(x)


def piece_rows(T: int) -> int:
    """Rows per kernel piece for a call of T rows: 16 up to 16 rows, else the next power of two up
    to `MAX_PIECE_ROWS` (a piece reads each of its rows' experts once)."""
    return BLOCK_ROWS if T <= BLOCK_ROWS else min(MAX_PIECE_ROWS, next_pow2(T))


def _launch_piece(x, ids, wts, gate_up, down, shared, num_tokens, row_off, h, y, out, pdl, BM):
    """Run the kernels on one piece of at most BM rows (gate/up, down, reduce); `out` is that piece's rows.
    `shared`: the shared expert's `(gate_up [2I, H], down [H, I], gate logits [rows, 1])`, or None.
    `out` None (`moe_experts_partials`): no reduce; `y` is that piece's rows of the op's output,
    every slot written (zeros where no expert is)."""
    from hybridspec.ops.moe_triton import moe_down_kernel, moe_gate_up_kernel, moe_reduce_kernel

    cfg = KERNEL_CONFIG
    T, H = x.shape
    K = ids.shape[1]
    E, I = gate_up.shape[0], down.shape[2]
    # every slot of the piece, read flat
    SP = next_pow2(BM * K)
    has_n = num_tokens is not None
    nt = num_tokens if has_n else ids
    # Triton's interpreter gets bf16 wrong (dots multiply bit patterns, casts truncate): there the
    # kernels upcast bf16 operands (exact products, fp32 sums as on the GPU) and round explicitly
    interp_bf16 = TRITON_INTERPRET and gate_up.dtype == torch.bfloat16
    # fp32 operands need ieee (the default is tf32); 16-bit operands ignore the setting
    prec = "ieee" if gate_up.dtype == torch.float32 or interp_bf16 else "tf32"
    launch_pdl = pdl_launch(pdl)
    has_s = shared is not None
    # without a shared expert its pointers are never read: any tensor of the right dtype
    s_gate_up, s_down, s_gate = shared if has_s else (gate_up, down, wts)
    slots = T * K + has_s
    # past 16 rows each routed expert's rows are gathered into 16-row tiles; the shared expert's
    # tile (every row) keeps the piece's BM rows and a narrower H chunk
    gather = BM > BLOCK_ROWS
    bn, bk, bk_wide = gate_up_blocks(cfg, H, I, BM, x.element_size())
    moe_gate_up_kernel[(slots, I // bn)](
        x, ids, nt, gate_up, s_gate_up, h, y,
        T, E, row_off, x.stride(0),
        H=H, I=I, K=K, BM=BM, KP=next_pow2(K), SP=SP, BN=bn, BK=bk, RB=BLOCK_ROWS, BK_WIDE=bk_wide, GATHER=gather,
        WRITE_ZEROS=gather and out is None, ZB=min(256, next_pow2(H)),
        HAS_NUM_TOKENS=has_n, HAS_SHARED=has_s, PRECISION=prec, INTERPRET_BF16=interp_bf16, USE_PDL=pdl,
        num_warps=cfg.gate_up_warps, num_stages=cfg.num_stages, **launch_pdl,
    )
    count_launch("moe_gate_up")
    bn, bk = down_blocks(cfg, H, I, BM)
    moe_down_kernel[(slots, H // bn)](
        h, ids, nt, down, s_down, y,
        T, E, row_off,
        H=H, I=I, K=K, BM=BM, KP=next_pow2(K), SP=SP, BN=bn, BK=bk, RB=BLOCK_ROWS, GATHER=gather,
        HAS_NUM_TOKENS=has_n, HAS_SHARED=has_s, PRECISION=prec, INTERPRET_BF16=interp_bf16, USE_PDL=pdl,
        WRITE_ALL=out is None, num_warps=cfg.down_warps, num_stages=cfg.num_stages, **launch_pdl,
    )
    count_launch("moe_down")
    if out is None:
        return
    bn = _block(cfg.reduce_block_h, H)
    moe_reduce_kernel[(T, H // bn)](
        y, ids, wts, nt, s_gate, out,
        T, E, row_off, wts.stride(0), wts.stride(1), s_gate.stride(0), out.stride(0),
        H=H, K=K, BN=bn, HAS_NUM_TOKENS=has_n, HAS_SHARED=has_s,
        INTERPRET_BF16=TRITON_INTERPRET and out.dtype == torch.bfloat16, USE_PDL=pdl,
        num_warps=4, **launch_pdl,
    )
    count_launch("moe_reduce")


@torch.library.custom_op("hybridspec::moe_experts", mutates_args=(), device_types=None)
def _moe_experts_op(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    num_tokens: torch.Tensor | None,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    T, H = hidden.shape
    K = topk_ids.shape[1]
    if not use_triton(hidden):
        return naive_moe.moe_experts(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, num_tokens,
                                     shared_gate_up, shared_down, shared_gate)
    out = torch.empty(T, H, dtype=hidden.dtype, device=hidden.device)
    if T == 0:
        return out
    # the kernels read ids flat (a no-op for torch.topk's output)
    topk_ids = topk_ids.contiguous()
    BM = piece_rows(T)
    has_s = shared_gate_up is not None
    y = torch.empty(BM, K + has_s, H, dtype=torch.float32, device=hidden.device)  # [rows, k (+1), H]
    gate = shared_gate.reshape(T, 1) if has_s else None
    launch_pieces(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, num_tokens,
                  (shared_gate_up, shared_down, gate) if has_s else None, y, out)
    return out


def launch_pieces(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, num_tokens, shared, y, out) -> None:
    """The kernels over consecutive pieces of `piece_rows(T)` rows (beyond 64 rows each piece reads
    its own experts once: correct and graph-capturable; long prefills are better served by a grouped
    GEMM). `shared`: `(gate_up, down, gate logits [T, 1] or None)` or None; `topk_weights` and the gate
    logits may be None without a reduce. With `out` `[T, H]`, `y`
    is scratch of one piece's rows, shared by the pieces (stream order, and under pdl each kernel's
    wait, keeps them apart); with `out` None, `y` is the `[T, k (+1), H]` result, no reduce runs."""
    T, H = hidden.shape
    BM = piece_rows(T)
    E, I = gate_up_proj.shape[0], down_proj.shape[2]
    has_s = shared is not None
    # h is indexed by expert (each expert has one leading slot per piece; the shared expert is
    # index E), y by assignment (the shared expert's after the k routed ones)
    h = torch.empty(E + has_s, BM, I, dtype=gate_up_proj.dtype, device=hidden.device)  # [experts, rows, I]
    pdl = _use_pdl(KERNEL_CONFIG, hidden)
    for r0 in range(0, T, BM):
        r1 = min(r0 + BM, T)
        # the reduce alone reads the routing weights and the shared gate (None without a reduce)
        rows = slice(r0, r1)
        wts = None if topk_weights is None else topk_weights[rows]
        piece_shared = None if shared is None else (*shared[:2], None if shared[2] is None else shared[2][rows])
        _launch_piece(hidden[rows], topk_ids[rows], wts, gate_up_proj, down_proj, piece_shared, num_tokens, r0, h,
                      y if out is not None else y[rows], None if out is None else out[rows], pdl, BM)


@_moe_experts_op.register_fake
def _(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, num_tokens, shared_gate_up=None, shared_down=None,
      shared_gate=None):
    return hidden.new_empty(hidden.shape)


def moe_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    num_tokens: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """SwiGLU experts of transformers' `Qwen3_5MoeExperts`, reading each selected expert once.

    `hidden` `[T, H]`; `topk_ids` (integer) and `topk_weights` (float) `[T, k]`; `gate_up_proj`
    `[E, 2I, H]` (gate rows first, then up) and `down_proj` `[E, H, I]`, contiguous, in the dtype of
    `hidden`. Returns `[T, H]` in that dtype: `sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)`,
    `e = topk_ids[t, j]`, accumulated in fp32 (the SwiGLU output is rounded to the weight dtype,
    as transformers does). Assignments whose id is outside `[0, E)` contribute nothing.

    `num_tokens`: optional integer tensor with one element (shape `[1]` or `[]`) on the device of
    `hidden`. Rows at or past it produce zeros and read no expert weights; their ids may be garbage
    and their hidden states NaN. T <= 64 is one piece (three launches: a batch of up to four
    verification windows reads each expert of their union once); larger T runs consecutive 64-row
    pieces, each reading the experts its rows select. On sm90+ GPUs the launches of a piece
    overlap through programmatic dependent launch unless `KERNEL_CONFIG.pdl` is off.

    `shared`: the sparse MoE block's shared expert and its gate, `(gate_up [2I, H], down [H, I],
    gate_logits [T] or [T, 1])`, the same I and dtype as the routed experts (`gate_up` may be rows
    of a larger buffer: contiguous rows; the logits any row stride). Then the result is the whole
    block, `round(round(routed) + round(round(sigmoid(gate)) * round(shared(x))))` per counted row:
    transformers' block-level roundings in the weights' dtype (inside each expert, as for the routed
    ones, only the SwiGLU product is rounded, where transformers rounds each projection and the
    activation, and the routed sum is fp32 where transformers adds expert by expert in the weights'
    dtype). The shared expert runs in the same three launches as one more expert every counted row
    chose; rows past `num_tokens` stay zero.
    """
    check_inputs(hidden, topk_ids, gate_up_proj, down_proj, num_tokens)
    T, K = topk_ids.shape
    check(topk_weights.shape == (T, K),
          f"topk_weights must be [T, k] = [{T}, {K}] like topk_ids, got {tuple(topk_weights.shape)}")
    check(topk_weights.is_floating_point(), f"topk_weights must be a float tensor, got {topk_weights.dtype}")
    check(topk_weights.device == hidden.device, f"topk_weights is on {topk_weights.device}, hidden on {hidden.device}")
    if shared is None:
        return _moe_experts_op(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, num_tokens)
    check(len(shared) == 3, f"shared must be (gate_up, down, gate_logits), got {len(shared)} tensors")
    s_gate_up, s_down, s_gate = shared
    check_shared(hidden, down_proj, s_gate_up, s_down)
    check(s_gate.shape in ((T,), (T, 1)), f"shared gate logits must be [T] or [T, 1] with T = {T}, got {tuple(s_gate.shape)}")
    check(s_gate.dtype in FLOAT_INPUTS, f"the shared gate logits must have a float dtype, got {s_gate.dtype}")
    check(s_gate.device == hidden.device, f"shared gate logits is on {s_gate.device}, hidden on {hidden.device}")
    return _moe_experts_op(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, num_tokens,
                           s_gate_up, s_down, s_gate)


def check_inputs(hidden, topk_ids, gate_up_proj, down_proj, num_tokens) -> None:
    """The checks `moe_experts` and `moe_experts_partials` share: the shapes, dtypes, layouts and
    devices of the rows, the expert ids, the experts' weights and `num_tokens`."""
    check(hidden.dim() == 2, f"hidden must be [T, H], got {tuple(hidden.shape)}")
    T, H = hidden.shape
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == T and topk_ids.shape[1] >= 1,
          f"topk_ids must be [T, k] = [{T}, k], got {tuple(topk_ids.shape)}")
    check(gate_up_proj.dim() == 3 and gate_up_proj.shape[2] == H and gate_up_proj.shape[1] % 2 == 0,
          f"gate_up_proj must be [E, 2I, H] with H = {H}, got {tuple(gate_up_proj.shape)}")
    E, I = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    check(down_proj.shape == (E, H, I),
          f"down_proj must be [E, H, I] = [{E}, {H}, {I}] to match gate_up_proj {tuple(gate_up_proj.shape)}, "
          f"got {tuple(down_proj.shape)}")
    check(H % 16 == 0 and I % 16 == 0 and I > 0,
          f"H and I must be positive multiples of 16, got H = {H}, I = {I} (gate_up_proj {tuple(gate_up_proj.shape)})")
    check(hidden.dtype in FLOAT_INPUTS, f"hidden must be fp32, bf16 or fp16, got {hidden.dtype}")
    check(gate_up_proj.dtype == hidden.dtype and down_proj.dtype == hidden.dtype,
          f"gate_up_proj ({gate_up_proj.dtype}) and down_proj ({down_proj.dtype}) must have hidden's dtype {hidden.dtype}")
    check(is_integer(topk_ids),
          f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    check(hidden.stride(1) == 1, f"hidden must be contiguous in its last dim, got strides {hidden.stride()}")
    check(gate_up_proj.is_contiguous() and down_proj.is_contiguous(),
          f"gate_up_proj and down_proj must be contiguous, got strides {gate_up_proj.stride()} and {down_proj.stride()}")
    for name, t in (("topk_ids", topk_ids), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        check(t.device == hidden.device, f"{name} is on {t.device}, hidden on {hidden.device}")
    if num_tokens is not None:
        check(num_tokens.numel() == 1 and num_tokens.dim() <= 1 and is_integer(num_tokens),
              f"num_tokens must be an integer tensor of shape [1] or [], got {num_tokens.dtype} {tuple(num_tokens.shape)}")
        check(num_tokens.device == hidden.device, f"num_tokens is on {num_tokens.device}, hidden on {hidden.device}")


def check_shared(hidden, down_proj, s_gate_up, s_down) -> None:
    """The shared expert's weights: the routed experts' sizes and dtype, contiguous, on their device."""
    _, H, I = down_proj.shape
    check(s_gate_up.shape == (2 * I, H) and s_down.shape == (H, I),
          f"the shared expert must have the routed experts' sizes, gate_up [2I, H] = [{2 * I}, {H}] and down "
          f"[H, I] = [{H}, {I}], got {tuple(s_gate_up.shape)} and {tuple(s_down.shape)}")
    check(s_gate_up.dtype == hidden.dtype and s_down.dtype == hidden.dtype,
          f"the shared expert's weights must have hidden's dtype {hidden.dtype}, got {s_gate_up.dtype} and {s_down.dtype}")
    check(s_gate_up.is_contiguous() and s_down.is_contiguous(),
          f"the shared expert's weights must be contiguous, got strides {s_gate_up.stride()} and {s_down.stride()}")
    for name, t in (("shared gate_up", s_gate_up), ("shared down", s_down)):
        check(t.device == hidden.device, f"{name} is on {t.device}, hidden on {hidden.device}")
