"""`hybridspec::decode_attention`: custom op, fake kernel and host wrapper for the attention of a
verification round (or an AR step) against the KV buffer.

Same form as the other ops (docs/design.md, "Ops"): the body launches the Triton kernels
(hybridspec/ops/attention_triton.py) for CUDA tensors, and for CPU tensors under
`TRITON_INTERPRET=1`, and runs the naive twin (hybridspec/ops/naive_attention.py) otherwise. Two
launches (split, combine), no host read of the length: the split count is fixed by the buffer's
shape and the device, the split sizes by the device length inside the kernels, so a captured graph
serves every length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.ops import naive_attention
from hybridspec.ops.checks import FLOAT_INPUTS, check, check_lengths, dot_precision, next_pow2
from hybridspec.ops.dispatch import TRITON_INTERPRET, count_launch, pdl_launch, use_pdl, use_triton

MAX_HEAD_DIM = 256


@dataclass
class AttentionKernelConfig:
    """Tiles and split policy; `benchmarks/bench_kernels.py --sweep` tries other values.

    `block_m` caps the packed query rows (W x query heads per key head) per program; `block_n`
    is the positions per loop step (`block_n_large` at head dims above 128, where the tiles of a
    program would otherwise not fit its registers). The context is cut into
    `min(max_splits, ceil(programs_per_sm x SMs / (B x Hkv x row blocks)), ceil(S / block_n))` splits
    (`splits` overrides), fixed per buffer shape: the kernels size each split from the device
    length, and splits past it exit at once.
    """

    block_m: int = 64
    block_n: int = 64
    block_n_large: int = 32
    num_warps: int = 4
    num_warps_large: int = 8
    num_stages: int = 2
    programs_per_sm: int = 1
    max_splits: int = 64
    # split partials merged per step of the combine kernel
    combine_splits: int = 16
    splits: int | None = None


KERNEL_CONFIG = AttentionKernelConfig()
# the interpreter's stand-in for a device's SM count: enough splits to exercise the combine
_INTERPRET_SMS = 4


def _sm_count(t: torch.Tensor) -> int:
    if t.is_cuda and not TRITON_INTERPRET:
        return torch.cuda.get_device_properties(t.device).multi_processor_count
    return _INTERPRET_SMS


def launch_plan(cfg: AttentionKernelConfig, B: int, W: int, Hq: int, Hkv: int, S: int, D: int, sms: int,
                elem_size: int = 2) -> dict:
    """Tiles, grid and split count of one call (host arithmetic on shapes only). `elem_size`: bytes
    per element of q/keys/values."""
    rows = W * (Hq // Hkv)
    block_m = cfg.block_m
    if elem_size >= 4 and D > 128:
        # fp32 at head dim 256: 64 query rows + two stages of 32-position K/V tiles need 256 KB of
        # shared memory, over the H200's 227 KB (measured: Triton 3.6 refused it); 32 rows need 160 KB
        block_m = min(block_m, 32)
    bm = min(max(16, next_pow2(rows)), max(16, next_pow2(block_m)))
    large = D > 128
    bn = max(16, next_pow2(cfg.block_n_large if large else cfg.block_n))
    row_blocks = -(-rows // bm)
    splits = cfg.splits
    if splits is None:
        splits = min(cfg.max_splits, max(1, -(-cfg.programs_per_sm * sms // (B * Hkv * row_blocks))))
    splits = max(1, min(splits, -(-S // bn)))
    return {
        "BM": bm, "BN": bn, "row_blocks": row_blocks, "splits": splits,
        "num_warps": cfg.num_warps_large if large else cfg.num_warps, "num_stages": cfg.num_stages,
        "CS": min(next_pow2(splits), max(1, next_pow2(cfg.combine_splits))),
    }


@torch.library.custom_op("hybridspec::decode_attention", mutates_args=(), device_types=None)
def _decode_attention_op(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    gate: torch.Tensor | None,
    scale: float,
    starts: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    if not use_triton(q):
        return naive_attention.decode_attention(q, keys, values, lengths, scale, gate, starts, causal)
    from hybridspec.ops.attention_triton import decode_attention_combine_kernel, decode_attention_split_kernel

    B, W, Hq, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    plan = launch_plan(KERNEL_CONFIG, B, W, Hq, Hkv, S, D, _sm_count(q), q.element_size())
    splits = plan["splits"]
    DP = max(16, next_pow2(D))
    # one length for every row: read it with stride 0
    s_len = lengths.stride(0) if lengths.shape[0] == B and B > 1 else 0
    s_start = starts.stride(0) if starts is not None and starts.shape[0] == B and B > 1 else 0
    interp16 = TRITON_INTERPRET and q.dtype != torch.float32
    pdl = use_pdl(q)
    # only split partials below the device length are written, and only those are read
    o_part = torch.empty(B * Hkv, splits, W * G, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B * Hkv, splits, W * G, dtype=torch.float32, device=q.device)
    decode_attention_split_kernel[(splits, B * Hkv, plan["row_blocks"])](
        q, keys, values, lengths, starts if starts is not None else lengths, o_part, lse_part,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        s_len, s_start,
        W=W, G=G, HKV=Hkv, D=D, DP=DP, BM=plan["BM"], BN=plan["BN"], SPLITS=splits, HAS_START=starts is not None,
        CAUSAL=causal,
        PRECISION=dot_precision(q),
        UPCAST=interp16, ROUND_BF16=interp16 and q.dtype == torch.bfloat16,
        USE_PDL=pdl, num_warps=plan["num_warps"], num_stages=plan["num_stages"], **pdl_launch(pdl),
    )
    count_launch("decode_attention_split")
    out = torch.empty(B, W, Hq, D, dtype=q.dtype, device=q.device)
    g = gate if gate is not None else out
    decode_attention_combine_kernel[(B * Hkv, W * G)](
        o_part, lse_part, lengths, g, out,
        s_len, g.stride(0), g.stride(1), g.stride(2), out.stride(0), out.stride(1), out.stride(2),
        W=W, G=G, HKV=Hkv, D=D, DP=DP, BN=plan["BN"], SPLITS=splits, CS=plan["CS"],
        HAS_GATE=gate is not None, ROUND_BF16=TRITON_INTERPRET and q.dtype == torch.bfloat16,
        USE_PDL=pdl, num_warps=4 if DP >= 128 else 2, **pdl_launch(pdl),
    )
    count_launch("decode_attention_combine")
    return out


@_decode_attention_op.register_fake
def _(q, keys, values, lengths, gate, scale, starts=None, causal=True):
    return q.new_empty(q.shape)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
    gate: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of W new rows against a KV buffer that already holds them, causal among the new
    rows unless `causal=False`, reading only the positions below `L + W`.

    `q` `[B, W, Hq, D]` (any strides, last dim contiguous); `keys`, `values` `[B, Hkv, S, D]`
    (the `HybridState` buffers; last dim contiguous), Hq a multiple of Hkv (query head h reads key
    head `h // (Hq / Hkv)`), D <= 256; one dtype (fp32, bf16 or fp16) throughout. `lengths`: integer
    `[B]` (or `[1]`, one for every row) on the device: `L`, the positions before the new rows, which
    sit at `L .. L + W - 1`; row i sees positions `0 .. L + i`. `L + W <= S` is the caller's promise
    (checking it would read the device). `scale` defaults to `D ** -0.5`. `gate` `[B, W, Hq, D]`
    (last dim contiguous): the output is multiplied by `sigmoid(gate)` (Qwen3.5's gated attention),
    in fp32 before the one rounding. `starts`: integer `[B]` (or `[1]`) on the device, each row's
    first visible position (its left padding: row i then sees `starts .. L + i`); None: 0.
    `causal=False`: every new row sees the whole block, positions `starts .. L + W - 1` (the DFlash
    drafter's non-causal layers). Returns
    `[B, W, Hq, D]` contiguous in the dtype of `q`; softmax and accumulation in fp32.
    """
    check(q.dim() == 4, f"q must be [B, W, Hq, D], got {tuple(q.shape)}")
    B, W, Hq, D = q.shape
    check(B >= 1 and W >= 1, f"q must have at least one batch row and one query row, got {tuple(q.shape)}")
    check(keys.dim() == 4 and keys.shape[0] == B and keys.shape[3] == D,
          f"keys must be [B, Hkv, S, D] = [{B}, Hkv, S, {D}], got {tuple(keys.shape)}")
    check(values.shape == keys.shape, f"values must match keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    Hkv, S = keys.shape[1], keys.shape[2]
    check(Hkv >= 1 and Hq % Hkv == 0,
          f"query heads ({Hq}) must be a multiple of key heads ({Hkv}): q {tuple(q.shape)}, keys {tuple(keys.shape)}")
    check(1 <= D <= MAX_HEAD_DIM, f"head dim must be in 1..{MAX_HEAD_DIM}, got q {tuple(q.shape)}")
    check(S >= W, f"the buffer ({S} positions) must hold at least the W = {W} new rows: keys {tuple(keys.shape)}")
    check(q.dtype in FLOAT_INPUTS, f"q must be fp32, bf16 or fp16, got {q.dtype}")
    check(keys.dtype == q.dtype and values.dtype == q.dtype,
          f"keys ({keys.dtype}) and values ({values.dtype}) must have q's dtype {q.dtype}")
    for name, t in (("q", q), ("keys", keys), ("values", values)):
        check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    if gate is not None:
        check(gate.shape == q.shape, f"gate must be [B, W, Hq, D] = {list(q.shape)}, got {tuple(gate.shape)}")
        check(gate.dtype == q.dtype, f"gate must have q's dtype {q.dtype}, got {gate.dtype}")
        check(gate.stride(-1) == 1, f"gate must be contiguous in its last dim, got strides {gate.stride()}")
    check_lengths("lengths", lengths, B, q.device, one_for_all=True)
    check_lengths("starts", starts, B, q.device, one_for_all=True)
    for name, t in (("keys", keys), ("values", values), ("gate", gate)):
        if t is not None:
            check(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
    return _decode_attention_op(q, keys, values, lengths, gate, D**-0.5 if scale is None else float(scale), starts,
                                bool(causal))
