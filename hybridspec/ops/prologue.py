"""`hybridspec::attention_prologue`: custom op, fake kernel and host wrapper for what the attention
mixer does between its projections and `decode_attention`: q and k RMSNorm, rotary embedding, and
the new rows' keys and values written into the KV buffers at the device-resident length.

Same form as the other ops (docs/design.md, "Ops"): the body launches the Triton kernel
(hybridspec/ops/prologue_triton.py) for CUDA tensors, and for CPU tensors under
`TRITON_INTERPRET=1`, and runs the naive twin (hybridspec/ops/naive_prologue.py) otherwise. One
launch, no host read of the length.
"""

from __future__ import annotations

import torch

from hybridspec.ops import naive_prologue
from hybridspec.ops.attention import MAX_HEAD_DIM
from hybridspec.ops.checks import FLOAT_INPUTS, check, check_lengths, next_pow2
from hybridspec.ops.dispatch import TRITON_INTERPRET, count_launch, pdl_launch, use_pdl, use_triton

# `fused`: the attention layers run this op (`patches.common.fused_prologue`) instead of the norms,
# rotary and `index_put` writes under inductor. On an H100 (2026-12-07, one process, alternating
# variant rows) the AR step took 3.295 / 3.299 / 3.300 ms with it against 3.321 / 3.323 without, and
# the captured AR runner stayed exact against the fp32 target, both families (docs/benchmarks.md,
# "The attention prologue in one kernel"); not yet run on an H200. `benchmarks/bench_runner.py
# --ar-attention "fused=0;fused=1"` times both forms in one process.
PROLOGUE_CONFIG = {"fused": 1}


@torch.library.custom_op("hybridspec::attention_prologue", mutates_args=("keys", "values"), device_types=None)
def _attention_prologue_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    offset: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    if not use_triton(q):
        return naive_prologue.attention_prologue(q, k, v, q_weight, k_weight, eps, offset, cos, sin, keys, values,
                                                 lengths)
    from hybridspec.ops.prologue_triton import attention_prologue_kernel

    B, W, Hq, D = q.shape
    Hkv = k.shape[2]
    out = torch.empty(B, W, Hq, D, dtype=q.dtype, device=q.device)
    s_len = lengths.stride(0) if lengths.shape[0] == B and B > 1 else 0
    # cos / sin may broadcast over the batch (one position row for every sequence)
    s_cb = cos.stride(0) if cos.shape[0] == B and B > 1 else 0
    s_sb = sin.stride(0) if sin.shape[0] == B and B > 1 else 0
    pdl = use_pdl(q)
    attention_prologue_kernel[(B * W, Hq + Hkv)](
        q, k, v, q_weight, k_weight, cos, sin, keys, values, lengths, out,
        float(eps), float(offset),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        s_cb, cos.stride(1), s_sb, sin.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        s_len, out.stride(0), out.stride(1), out.stride(2),
        W=W, HQ=Hq, D=D, DP=max(16, next_pow2(D)), R=cos.shape[-1],
        INTERPRET_BF16=TRITON_INTERPRET and q.dtype == torch.bfloat16,
        USE_PDL=pdl, num_warps=1 if D <= 128 else 2, **pdl_launch(pdl),
    )
    count_launch("attention_prologue")
    return out


@_attention_prologue_op.register_fake
def _(q, k, v, q_weight, k_weight, eps, offset, cos, sin, keys, values, lengths):
    return q.new_empty(q.shape)


def attention_prologue(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    *,
    eps: float,
    offset: float = 1.0,
) -> torch.Tensor:
    """q and k RMSNorm (`x * rsqrt(mean(x^2) + eps) * (offset + weight)` in fp32, rounded to the
    input dtype: transformers' zero-centred Qwen3.5 / Qwen3-Next norm at `offset` 1, a plain one at
    0), the rotary embedding on the first R dims (`apply_rotary_pos_emb`'s `rotate_half` form, each
    product and the sum rounded to the input dtype), then k and v written into the KV buffers.

    `q` `[B, w, Hq, D]`, `k`, `v` `[B, w, Hkv, D]` (any strides, last dim contiguous: views of a
    fused projection's output do); `q_weight`, `k_weight` `[D]`; `cos`, `sin` `[B or 1, w, R]`
    (R <= D, even; last dim contiguous) in the input dtype; `keys`, `values` `[B, Hkv, S, D]`
    (the `HybridState` buffers), written at positions `L_b .. L_b + w - 1`, `lengths` `[B]` (or
    `[1]`, one for every row) an integer tensor on the device; `L + w <= S` is the caller's promise
    (checking it would read the device). Hq a multiple of Hkv, D <= 256, one float dtype
    throughout. Returns the normed, rotated q `[B, w, Hq, D]`, contiguous."""
    check(q.dim() == 4, f"q must be [B, w, Hq, D], got {tuple(q.shape)}")
    B, W, Hq, D = q.shape
    check(B >= 1 and W >= 1, f"q must have at least one batch row and one query row, got {tuple(q.shape)}")
    check(k.dim() == 4 and k.shape[:2] == (B, W) and k.shape[3] == D,
          f"k must be [B, w, Hkv, D] = [{B}, {W}, Hkv, {D}], got {tuple(k.shape)}")
    check(v.shape == k.shape, f"v must match k {tuple(k.shape)}, got {tuple(v.shape)}")
    Hkv = k.shape[2]
    check(Hkv >= 1 and Hq % Hkv == 0, f"query heads ({Hq}) must be a multiple of key heads ({Hkv})")
    check(1 <= D <= MAX_HEAD_DIM, f"head dim must be in 1..{MAX_HEAD_DIM}, got q {tuple(q.shape)}")
    check(q.dtype in FLOAT_INPUTS, f"q must be fp32, bf16 or fp16, got {q.dtype}")
    for name, t in (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("keys", keys), ("values", values)):
        check(t.dtype == q.dtype, f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        check(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
        check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    check(q.stride(-1) == 1, f"q must be contiguous in its last dim, got strides {q.stride()}")
    for name, wt in (("q_weight", q_weight), ("k_weight", k_weight)):
        check(wt.shape == (D,) and wt.is_floating_point() and wt.device == q.device and wt.is_contiguous(),
              f"{name} must be a contiguous float [{D}] tensor on {q.device}, got {wt.dtype} {tuple(wt.shape)} on {wt.device}")
    # one weight dtype: the kernel picks a weight pointer per program, and both must be one type
    check(k_weight.dtype == q_weight.dtype, f"q_weight ({q_weight.dtype}) and k_weight ({k_weight.dtype}) must share a dtype")
    check(cos.dim() == 3 and cos.shape[0] in (1, B) and cos.shape[1] == W and cos.shape == sin.shape,
          f"cos and sin must both be [B or 1, w, R] = [{B}, {W}, R], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    R = cos.shape[-1]
    check(2 <= R <= D and R % 2 == 0, f"the rotary dim R = {R} must be even and in 2..{D}")
    check(keys.dim() == 4 and keys.shape[0] == B and keys.shape[1] == Hkv and keys.shape[3] == D
          and keys.shape[2] >= W, f"keys must be [B, Hkv, S >= w, D] = [{B}, {Hkv}, S, {D}], got {tuple(keys.shape)}")
    check(values.shape == keys.shape, f"values must match keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    check_lengths("lengths", lengths, B, q.device, one_for_all=True)
    return _attention_prologue_op(q, k, v, q_weight, k_weight, float(eps), float(offset), cos, sin, keys, values,
                                  lengths)
