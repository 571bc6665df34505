"""Naive twin of `hybridspec::moe_experts`: a loop over the selected experts, like transformers' eager path.

It syncs with the host (which experts were hit) and is the oracle for the kernels. It computes in
fp32 and rounds the SwiGLU output to the weight dtype before the down projection, as the kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, num_tokens=None):
    """`[T, H]` in the dtype of `hidden`; rows at or past `num_tokens` and ids outside `[0, E)` give nothing."""
    T, H = hidden.shape
    E, I = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    rows_ok = torch.ones(T, dtype=torch.bool, device=hidden.device)  # [T]
    if num_tokens is not None:
        limit = num_tokens.reshape(()).to(device=hidden.device, dtype=torch.long)
        rows_ok = torch.arange(T, device=hidden.device) < limit
    ids = topk_ids.long()
    valid = rows_ok[:, None] & (ids >= 0) & (ids < E)  # [T, k]
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(ids[valid]).tolist():
        rows, pos = torch.where(valid & (ids == e))
        x = hidden[rows].float()  # [n_e, H]
        gate, up = (x @ gate_up_proj[e].float().T).split(I, dim=-1)  # [n_e, I] each
        act = (F.silu(gate) * up).to(down_proj.dtype).float()
        y = act @ down_proj[e].float().T  # [n_e, H]
        out.index_add_(0, rows, y * topk_weights[rows, pos].float()[:, None])
    return out.to(hidden.dtype)
