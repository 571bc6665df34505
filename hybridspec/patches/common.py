"""The verification forward shared by the hybrid families: transformers' own modules for
embedding, norms, MoE and LM head; our GDN ops, conv-window and KV-buffer handling in between.
Linears a tensor-parallel plan shards go through `hybridspec.parallel` (local shard, the style's
collective); unsharded ones are called as they are."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
# the same eager attention for every family (repeat_kv, fp32 softmax)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import eager_attention_forward

from hybridspec import parallel
from hybridspec.experts import hybridspec_experts_forward
from hybridspec.ops import gdn_verify
from hybridspec.state import GDNSlot


def conv_verify(mod, mixed: torch.Tensor, slot: GDNSlot) -> torch.Tensor:
    """Causal depthwise conv of the round's pre-conv inputs `[B, C, w]` after the layer's window,
    as transformers' single-step update does it; the inputs are kept for the commit."""
    w = mixed.shape[-1]
    slot.inputs[:, :, :w] = mixed
    full = torch.cat([slot.window, mixed], dim=-1).to(mod.conv1d.weight.dtype)
    out = F.conv1d(full, mod.conv1d.weight, mod.conv1d.bias, padding=0, groups=full.shape[1])[..., -w:]
    return ACT2FN[mod.activation](out).to(mixed.dtype)


def gdn_core(mod, q, k, v, g, beta, z, slot: GDNSlot, num_tokens: torch.Tensor | None) -> torch.Tensor:
    """GDN verify of one layer into the round's factor buffers, then the gated norm and out_proj."""
    B, w = q.shape[:2]
    o, _ = gdn_verify(q, k, v, g, beta, slot.state, num_tokens=num_tokens, factors_out=slot.factors)
    o = mod.norm(o.reshape(-1, mod.head_v_dim), z.reshape(-1, mod.head_v_dim))
    return parallel.column(mod.out_proj, o.reshape(B, w, -1), gather=True)


def attention_verify(mod, x: torch.Tensor, cos_sin, keys: torch.Tensor, values: torch.Tensor, start,
                     apply_rope) -> torch.Tensor:
    """Gated attention of w new tokens against one layer's KV buffers `[B, Hkv, rows, D]`: write w
    rows at `start` (the committed length, a `[1]` device tensor). Under tensor parallelism the
    heads, and so the KV buffers, are this rank's; o_proj sums the ranks' partial products."""
    B, w, _ = x.shape
    hidden_shape = (B, w, -1, mod.head_dim)
    q, gate = torch.chunk(parallel.column(mod.q_proj, x, gather=False).view(B, w, -1, mod.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(B, w, -1)
    q = mod.q_norm(q.reshape(hidden_shape)).transpose(1, 2)
    k = mod.k_norm(parallel.column(mod.k_proj, x, gather=False).view(hidden_shape)).transpose(1, 2)
    v = parallel.column(mod.v_proj, x, gather=False).view(hidden_shape).transpose(1, 2)
    q, k = apply_rope(q, k, *cos_sin)
    rows = start + torch.arange(w, device=x.device)  # [w]
    # positions live on the device, so write by index and attend over the whole buffer under a
    # mask; rows past the round's w are computed and never used
    keys.index_copy_(2, rows, k)
    values.index_copy_(2, rows, v)
    # query i sits at position start + i and sees keys 0..start + i
    allowed = torch.arange(keys.shape[2], device=x.device)[None, :] <= rows[:, None]
    impl = mod.config._attn_implementation
    if impl == "eager" or impl is None:
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=x.device).masked_fill(~allowed, torch.finfo(q.dtype).min)
    else:
        mask = allowed
    mask = mask[None, None].expand(B, 1, w, keys.shape[2])
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
    out, _ = attend(mod, q, keys, values, mask, dropout=0.0, scaling=mod.scaling)
    out = out.reshape(B, w, -1) * torch.sigmoid(gate)
    return parallel.row(mod.o_proj, out)


def is_sparse_moe(mlp) -> bool:
    return hasattr(mlp, "gate") and hasattr(mlp, "experts") and hasattr(mlp, "shared_expert")


def route(mlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's own router on `[B, w, H]` -> expert ids and routing weights `[B, w, k]`."""
    B, w, H = x.shape
    # `forward`, not the module call: transformers hooks the router to collect router logits, and
    # the hook reads a ContextVar, which dynamo cannot trace (a graph break inside every compiled
    # layer, and an error inside torch.cond). Verification never returns router logits.
    _, weights, ids = mlp.gate.forward(x.reshape(-1, H))
    return ids.view(B, w, -1), weights.view(B, w, -1)


def moe_apply(mlp, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts on `hybridspec.ops.moe_experts` (cost follows the distinct experts the w
    tokens touch) plus the block's own shared expert; `x` `[B, w, H]`, `ids`/`weights` `[B, w, k]`.
    `num_tokens` (`[1]`, batch one): rows past it read no expert and get the shared expert only."""
    B, w, H = x.shape
    flat = x.reshape(-1, H)
    routed = hybridspec_experts_forward(mlp.experts, flat, ids.reshape(B * w, -1), weights.reshape(B * w, -1),
                                        num_tokens=num_tokens)
    gate = torch.sigmoid(mlp.shared_expert_gate(flat))
    down = mlp.experts.down_proj
    if not parallel.is_sharded(down):
        return (routed + gate * dense_mlp(mlp.shared_expert, flat)).reshape(B, w, H)
    # this rank ran its slice of every expert's width: `routed` is a partial sum
    group = parallel.group_of(down)
    if not parallel.is_sharded(mlp.shared_expert.down_proj.weight):
        return (parallel.all_reduce(routed, group) + gate * dense_mlp(mlp.shared_expert, flat)).reshape(B, w, H)
    # the shared expert's output is a partial sum too: both are reduced together (transformers'
    # plan reduces each on its own)
    shared = gate * parallel.row_partial(mlp.shared_expert.down_proj, _swiglu_local(mlp.shared_expert, flat))
    return parallel.all_reduce(routed + shared, group).reshape(B, w, H)


def _swiglu_local(mlp, x: torch.Tensor) -> torch.Tensor:
    """`act(gate_proj(x)) * up_proj(x)`: this rank's slice of the intermediate features."""
    return mlp.act_fn(parallel.column(mlp.gate_proj, x, gather=False)) * parallel.column(mlp.up_proj, x, gather=False)


def dense_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU MLP block (`gate_proj`, `up_proj`, `down_proj`), sharded or not."""
    if not parallel.is_sharded(mlp.down_proj.weight):
        out = mlp(x)
        return out[0] if isinstance(out, tuple) else out
    return parallel.row(mlp.down_proj, _swiglu_local(mlp, x))


def moe_verify(mlp, x: torch.Tensor, routing: list | None = None, num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE block of a verified block; a sparse block appends its expert ids `[B, w, k]` to
    `routing` when given. Dense MLP layers run as they are."""
    if not is_sparse_moe(mlp):
        return dense_mlp(mlp, x)
    ids, weights = route(mlp, x)
    if routing is not None:
        routing.append(ids)
    return moe_apply(mlp, x, ids, weights, num_tokens)
