"""The DFlash decoder layer: Qwen3 building blocks from transformers (RMSNorm, MLP, RoPE) around
an attention whose keys/values are the context features followed by the block.

Context features are the target's taps after the drafter's `fc` and `hidden_norm`; they enter each
layer's keys/values through that layer's `k_proj`/`v_proj`/`k_norm` only (no layer norm), and the
block, after the layer's input norm, supplies the queries and the remaining keys/values.

Drafting (`DFlashDrafter.propose`) writes the block's keys/values into the context cache at rows
`L .. L + W - 1` (`CacheBlock`); a layer without a sliding window then attends with
`hybridspec.ops.decode_attention`, which reads rows `start .. L + W - 1` only and needs no mask, and
a sliding-window layer with SDPA over the whole cache under a `visibility` mask. `LayerBlocks` holds
the per-layer-kind functions `propose` calls: eager, or compiled once per kind (regional
compilation, as the target's `hybridspec.patches.forward.Blocks`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, apply_rotary_pos_emb, rotate_half

from hybridspec.drafter.config import DFlashConfig
from hybridspec.fused import fuse, project
from hybridspec.ops import decode_attention
from hybridspec.split_projection import split_out_projection


class CacheBlock(NamedTuple):
    """Where a drafted block sits in the context cache. `batch` `[B, 1]`: 0..B-1; `rows` `[B, W]`:
    the cache rows `L .. L + W - 1` of each batch row; `length` `[B]`: L; `start` `[B]`: each row's
    first valid cache row (its left padding)."""

    batch: torch.Tensor
    rows: torch.Tensor
    length: torch.Tensor
    start: torch.Tensor


def visibility(q_pos, k_pos, causal, window, limit=None, first=None):
    """Bool `[B, 1, Q, K]`: which keys each query sees (None: all). Positions are target positions;
    `limit` `[B]` hides cache rows at or past it, `first` `[B]` those before it (left padding).
    Same rule as the reference's mask."""
    if not causal and window is None and limit is None and first is None:
        return None
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    visible = torch.ones(q.shape[0], q.shape[1], k.shape[2], dtype=torch.bool, device=q.device)
    if limit is not None:
        visible &= k < limit[:, None, None]
    if first is not None:
        visible &= k >= first[:, None, None]
    if causal:
        visible &= k <= q
    if window is not None:
        visible &= q - k < window
        if not causal:
            visible &= k - q < window
    return visible[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config, is_causal: bool, sliding_window: int | None):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal, self.sliding_window = is_causal, sliding_window
        bias, hidden, d = config.attention_bias, config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def context_kv(self, ctx, cos, sin, fused: bool = False):
        """Keys (normed, rotated) and values `[B, KVH, C, d]` of context features `ctx` `[B, C, H]`.
        `fused` (drafting only, as in `forward`): the k and v projections as one GEMM over their rows
        of the fused q/k/v weight where the drafter fused it; the training forward runs the linears,
        whose parameters are what autograd sees."""
        kv = project(self, "qkv", (self.q_proj, self.k_proj, self.v_proj), ctx, skip=1) if fused else None
        k, v = kv or (self.k_proj(ctx), self.v_proj(ctx))
        shape = (*ctx.shape[:2], self.num_kv_heads, self.head_dim)
        k = self.k_norm(k.view(shape)).transpose(1, 2)
        v = v.view(shape).transpose(1, 2)
        return k * cos[:, None] + rotate_half(k) * sin[:, None], v

    def forward(self, x, cos, sin, mask, past, block: CacheBlock | None = None):
        """`x` `[B, T, H]` (block, after the input norm). `past`: context keys/values `[B, KVH, C, d]`.
        Without `block` the block's keys/values are appended to them and SDPA runs under `mask` (the
        stateless and training forwards). With `block`, `past` is the context cache: the block's
        keys/values are written at its rows `block.rows`, and the queries attend over the cache,
        through `decode_attention` (`mask` unused, None) or, for a sliding-window layer, SDPA under
        `mask`."""
        B, T = x.shape[:2]
        linears = (self.q_proj, self.k_proj, self.v_proj)
        # one GEMM where the drafter fused them (`fuse_layers`), when drafting only: the stateless
        # forward (training) runs the linears, whose parameters are what autograd and an optimizer see
        fused = project(self, "qkv", linears, x) if block is not None else None
        q, k, v = fused or [lin(x) for lin in linears]
        q = self.q_norm(q.view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        past_k, past_v = past
        if block is None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        else:
            # an index_put, not a scatter: inductor writes it into the cache in place, where a
            # compiled scatter copied the whole cache layer out and back
            past_k[block.batch, :, block.rows] = k.transpose(1, 2)  # [B, T, KVH, d]
            past_v[block.batch, :, block.rows] = v.transpose(1, 2)
            if self.sliding_window is None:
                # the cache is decode_attention's `[B, Hkv, S, d]` layout with the block at L..L+W-1:
                # it reads rows start..L+W-1 only, where SDPA read every row of the cache under a mask
                out = decode_attention(q.transpose(1, 2), past_k, past_v, block.length, scale=self.scaling,
                                       starts=block.start, causal=self.is_causal)  # [B, T, Hq, d]
                out = out.reshape(B, T, -1)
                projected = split_out_projection(self.o_proj, out)
                return projected if projected is not None else self.o_proj(out)
            k, v = past_k, past_v
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        text = config.text
        self.self_attn = DFlashAttention(text, *config.layer_attention(layer_idx))
        self.mlp = Qwen3MLP(text)
        self.input_layernorm = Qwen3RMSNorm(text.hidden_size, eps=text.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(text.hidden_size, eps=text.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past, block: CacheBlock | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, past, block)
        y = self.post_attention_layernorm(x)
        # the fused gate/up GEMM when drafting (a cache block given), the module itself otherwise
        return x + (mlp_forward(self.mlp, y) if block is not None else self.mlp(y))


def mlp_forward(mlp: Qwen3MLP, x: torch.Tensor) -> torch.Tensor:
    """`Qwen3MLP.forward`, its gate and up projections one GEMM where they are fused (`fuse_layers`)."""
    fused = project(mlp, "gate_up", (mlp.gate_proj, mlp.up_proj), x)
    if fused is None:
        return mlp(x)
    gate, up = fused
    act = mlp.act_fn(gate) * up
    down = split_out_projection(mlp.down_proj, act)
    return down if down is not None else mlp.down_proj(act)


def fuse_layers(layers) -> None:
    """Fuse each layer's q/k/v and MLP gate/up projections (`hybridspec.fused`: the weights stored
    once, as module buffers, the parameters views of them; re-linked when replaced)."""
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        fuse(attn, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj))
        fuse(mlp, "gate_up", (mlp.gate_proj, mlp.up_proj))


def full_block(layer: DFlashDecoderLayer, h, cos, sin, keys, values, block: CacheBlock) -> torch.Tensor:
    """One drafter layer without a sliding window on a drafted block: `decode_attention` over the
    layer's context cache `keys`/`values` `[B, KVH, rows, d]`, no mask."""
    return layer(h, cos, sin, None, (keys, values), block)


def sliding_block(layer: DFlashDecoderLayer, h, cos, sin, mask, keys, values, block: CacheBlock) -> torch.Tensor:
    """One sliding-window drafter layer on a drafted block: SDPA over the cache under `mask`."""
    return layer(h, cos, sin, mask, (keys, values), block)


def block_rope(rotary: nn.Module, x, positions):
    """`propose`'s RoPE `cos`/`sin` `[B, W, d]` at the block's `positions` `[B, W]` (`x` gives dtype and
    device): eagerly about ten small kernels a round."""
    return rotary(x, positions)


def head_input(norm: Qwen3RMSNorm, h):
    """The drafts' head input: the final norm of a block's hidden states `[B, W, H]`, less the
    anchor's row."""
    return norm(h)[:, 1:]


def context_inputs(fc: nn.Linear, norm: Qwen3RMSNorm, rotary: nn.Module, features, positions):
    """What every layer's context keys/values start from: the target's tap features `[B, n, taps * H]`
    through `fc` and `norm` (`ctx` `[B, n, H]`), and the RoPE `cos`/`sin` at `positions` `[B, n]`."""
    ctx = norm(fc(features.to(fc.weight.dtype)))
    cos, sin = rotary(ctx, positions)
    return ctx, cos, sin


def context_block(attn: DFlashAttention, ctx, cos, sin, keys, values, batch, rows) -> None:
    """One layer's context keys and values (`DFlashAttention.context_kv`, k and v one GEMM) written
    into its cache `keys`/`values` `[B, KVH, rows, d]` at cache rows `rows` `[B, n]` (`batch` `[B, 1]`:
    0..B-1): an index_put, which inductor fuses with the norm and RoPE and writes in place."""
    k, v = attn.context_kv(ctx, cos, sin, fused=True)
    keys[batch, :, rows] = k.transpose(1, 2)  # [B, n, KVH, d]
    values[batch, :, rows] = v.transpose(1, 2)


class LayerBlocks(NamedTuple):
    """The per-layer functions `DFlashDrafter.propose` and `observe` call: eager (`EAGER`), or compiled
    once per layer kind (`compiled_once(LayerBlocks, layer_options())`). They take modules and tensors
    only, so every layer of a kind shares one compiled graph (its parameters are graph inputs).
    `rope` and `head_input` are `propose`'s around the layers; `context_inputs` and `context` are
    `observe`'s: eagerly about 20 small kernels a layer (two projections, the k norm, RoPE, two
    scatters) in every round's commit."""

    full: object = full_block
    sliding: object = sliding_block
    rope: object = block_rope
    head_input: object = head_input
    context_inputs: object = context_inputs
    context: object = context_block

EAGER = LayerBlocks()
