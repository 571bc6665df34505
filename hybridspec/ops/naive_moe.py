"""Naive twin of `hybridspec::moe_experts`: a loop over the selected experts, like transformers' eager path.

It syncs with the host (which experts were hit) and is the oracle for the kernels. It computes in
fp32 and rounds the SwiGLU output to the weight dtype before the down projection, as the kernels do.
With a shared expert it adds `round(round(sigmoid(gate)) * round(shared))` to the rounded routed sum
and rounds once more: the block-level roundings of transformers' sparse MoE block in the weights'
dtype (inside an expert only the SwiGLU product is rounded, as for the routed experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert on fp32 rows `x`: `gate_up` `[2I, H]`, `down` `[H, I]`; fp32 result, the SwiGLU
    output rounded to the weights' dtype first."""
    gate, up = (x @ gate_up.float().T).chunk(2, dim=-1)  # [n, I] each
    act = (F.silu(gate) * up).to(down.dtype).float()
    return act @ down.float().T


def moe_experts(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, num_tokens=None,
                shared_gate_up=None, shared_down=None, shared_gate=None):
    """`[T, H]` in the dtype of `hidden`; rows at or past `num_tokens` and ids outside `[0, E)` give
    nothing. `shared_*`: the block's shared expert (`[2I, H]`, `[H, I]`) and its gate logits `[T]`
    or `[T, 1]`, added to every counted row."""
    T, H = hidden.shape
    E = gate_up_proj.shape[0]
    rows_ok = torch.ones(T, dtype=torch.bool, device=hidden.device)  # [T]
    if num_tokens is not None:
        limit = num_tokens.reshape(()).to(device=hidden.device, dtype=torch.long)
        rows_ok = torch.arange(T, device=hidden.device) < limit
    ids = topk_ids.long()
    valid = rows_ok[:, None] & (ids >= 0) & (ids < E)  # [T, k]
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(ids[valid]).tolist():
        rows, pos = torch.where(valid & (ids == e))
        y = swiglu_expert(hidden[rows].float(), gate_up_proj[e], down_proj[e])  # [n_e, H]
        out.index_add_(0, rows, y * topk_weights[rows, pos].float()[:, None])
    if shared_gate_up is None:
        return out.to(hidden.dtype)
    dt = hidden.dtype
    x = torch.where(rows_ok[:, None], hidden.float(), 0.0)
    shared = swiglu_expert(x, shared_gate_up, shared_down).to(dt)
    gate = torch.sigmoid(shared_gate.reshape(T).float()).to(dt)
    total = (out.to(dt).float() + (gate.float()[:, None] * shared.float()).to(dt).float()).to(dt)
    return torch.where(rows_ok[:, None], total, torch.zeros((), dtype=dt))


def moe_experts_partials(hidden, topk_ids, gate_up_proj, down_proj, num_tokens=None, shared_gate_up=None,
                         shared_down=None):
    """`[T, k (+1), H]` fp32: each valid assignment's expert output (unweighted), the shared expert's
    output in the last slot where one is given (zero past `num_tokens`), zeros for the assignments
    that give nothing (rows past `num_tokens`, ids outside `[0, E)`)."""
    T, H = hidden.shape
    K = topk_ids.shape[1]
    E = gate_up_proj.shape[0]
    rows_ok = torch.ones(T, dtype=torch.bool, device=hidden.device)
    if num_tokens is not None:
        rows_ok = torch.arange(T, device=hidden.device) < num_tokens.reshape(()).to(device=hidden.device, dtype=torch.long)
    ids = topk_ids.long()
    valid = rows_ok[:, None] & (ids >= 0) & (ids < E)  # [T, k]
    y = torch.zeros(T, K + int(shared_gate_up is not None), H, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(ids[valid]).tolist():
        rows, pos = torch.where(valid & (ids == e))
        y[rows, pos] = swiglu_expert(hidden[rows].float(), gate_up_proj[e], down_proj[e])
    if shared_gate_up is not None:
        y[:, K] = swiglu_expert(torch.where(rows_ok[:, None], hidden.float(), 0.0), shared_gate_up, shared_down)
    return y
