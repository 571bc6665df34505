"""Decode attention of W new rows against a KV buffer, in fp32 over the whole buffer under a
position mask: the oracle for `attention_triton.py`, and the op's body on CPU.

Row i of batch row b sits at position `L_b + i` and sees positions `S_b .. L_b + i` (`S_b`: the
row's first valid position, its left padding; 0 without `starts`), or `S_b .. L_b + W - 1` when not
`causal` (the whole block: DFlash's draft block attends bidirectionally); the buffer
already holds the W new rows' keys and values at `L_b .. L_b + W - 1`. Positions at or past
`L_b + W`, and those before `S_b`, are never read (they may hold anything, NaN included): they are
replaced by zeros before any arithmetic.
"""

from __future__ import annotations

import torch


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """`q` `[B, W, Hq, D]`, `keys`/`values` `[B, Hkv, S, D]` (query head h reads key head
    `h // (Hq / Hkv)`, as transformers' `repeat_kv`), `lengths` `[B]` or `[1]` (one for every row)
    integer; `gate` `[B, W, Hq, D]` or None: the output times `sigmoid(gate)`; `starts` `[B]` or
    `[1]` integer or None: positions below a row's start are not seen (left padding); `causal`
False: every new row sees all W new rows. Returns
    `[B, W, Hq, D]` in the dtype of `q`, computed in fp32."""
    B, W, Hq, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    L = lengths.to(torch.long).expand(B)  # [B]
    pos = torch.arange(S, device=q.device)
    # [B, 1, S, 1]: the positions this call may read at all
    live = pos[None, :] < (L + W)[:, None]
    if starts is not None:
        live = live & (pos[None, :] >= starts.to(torch.long).expand(B)[:, None])
    live = live[:, None, :, None]
    k = torch.where(live, keys.float(), 0.0)
    v = torch.where(live, values.float(), 0.0)
    # [B, Hkv, G, W, D]: query head h * G + g of row i against key head h
    qf = q.float().reshape(B, W, Hkv, G, D).permute(0, 2, 3, 1, 4)
    scores = qf @ k[:, :, None].transpose(-1, -2) * scale  # [B, Hkv, G, W, S]
    # [B, W, S]: row i sees positions up to L + i, or every live one when not causal
    last = L[:, None] + (torch.arange(W, device=q.device) if causal else torch.full((W,), W - 1, device=q.device))
    visible = pos[None, None, :] <= last[:, :, None]
    if starts is not None:
        visible = visible & (pos[None, None, :] >= starts.to(torch.long).expand(B)[:, None, None])
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v[:, :, None]  # [B, Hkv, G, W, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(B, W, Hq, D)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    # the permuted product is a strided view: the op promises (and its fake declares) a contiguous
    # output, which a compiled graph asserts
    return out.to(q.dtype).contiguous()
