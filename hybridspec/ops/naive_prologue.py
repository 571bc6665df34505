"""The attention mixer's prologue in plain torch: the oracle for `prologue_triton.py` and the op's
body on CPU. What Qwen3.5 / Qwen3-Next attention does between its projections and the attention
itself, written as transformers writes it (`Qwen3_5MoeRMSNorm` / `Qwen3NextRMSNorm`, then
`apply_rotary_pos_emb` with a partial rotary dim), in the same roundings: the norm in fp32, scaled
by `offset + weight` and cast back to the input dtype; each rotary product and their sum rounded to
the input dtype (eager 16-bit ops). Then the keys and values of the w new rows are written into the
KV buffers at each batch row's committed length.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """transformers' zero-centred RMSNorm over the last dim (`offset` 1.0) or a plain one (0.0)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (offset + weight.float())).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_pos_emb` on `x` `[B, w, H, D]` with `cos`, `sin` `[B, w, R]` (R <= D, even):
    the first R dims rotated half against half, the rest passed through."""
    R = cos.shape[-1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    rot, rest = x[..., :R], x[..., R:]
    half = torch.cat((-rot[..., R // 2 :], rot[..., : R // 2]), dim=-1)
    return torch.cat(((rot * c) + (half * s), rest), dim=-1)


def attention_prologue(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, offset: float, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`q` `[B, w, Hq, D]`, `k`, `v` `[B, w, Hkv, D]`: q and k normed and rotated; k and v written to
    `keys`, `values` `[B, Hkv, S, D]` at positions `L_b .. L_b + w - 1` (`lengths` `[B]` or `[1]`).
    Returns the rotated q `[B, w, Hq, D]` (contiguous)."""
    B, w = q.shape[:2]
    q = rotate(rms_norm(q, q_weight, eps, offset), cos, sin)
    k = rotate(rms_norm(k, k_weight, eps, offset), cos, sin)
    rows = lengths.expand(B)[:, None].long() + torch.arange(w, device=q.device)  # [B, w]
    batch = torch.arange(B, device=q.device)[:, None]
    keys[batch, :, rows] = k
    values[batch, :, rows] = v
    return q.contiguous()
