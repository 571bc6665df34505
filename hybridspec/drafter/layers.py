"""The DFlash decoder layer: Qwen3 building blocks from transformers (RMSNorm, MLP, RoPE) around
an attention whose keys/values are the context features followed by the block.

Context features are the target's taps after the drafter's `fc` and `hidden_norm`; they enter each
layer's keys/values through that layer's `k_proj`/`v_proj`/`k_norm` only (no layer norm), and the
block, after the layer's input norm, supplies the queries and the remaining keys/values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, apply_rotary_pos_emb, rotate_half

from hybridspec.drafter.config import DFlashConfig


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

    def _heads(self, x, proj, n):
        return proj(x).view(*x.shape[:2], n, self.head_dim)  # [B, T, n, d]

    def context_kv(self, ctx, cos, sin):
        """Keys (normed, rotated) and values `[B, KVH, C, d]` of context features `ctx` `[B, C, H]`."""
        k = self.k_norm(self._heads(ctx, self.k_proj, self.num_kv_heads)).transpose(1, 2)
        v = self._heads(ctx, self.v_proj, self.num_kv_heads).transpose(1, 2)
        return k * cos[:, None] + rotate_half(k) * sin[:, None], v

    def forward(self, x, cos, sin, mask, past, write_index=None):
        """`x` `[B, T, H]` (block, after the input norm). `past`: context keys/values. Without
        `write_index` the block's keys/values are appended to them; with it (`[B, KVH, T, d]`, rows
        of the cache) they are written into the cache, and the query attends over the whole cache."""
        B, T = x.shape[:2]
        q = self.q_norm(self._heads(x, self.q_proj, self.num_heads)).transpose(1, 2)
        k = self.k_norm(self._heads(x, self.k_proj, self.num_kv_heads)).transpose(1, 2)
        v = self._heads(x, self.v_proj, self.num_kv_heads).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        past_k, past_v = past
        if write_index is None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        else:
            past_k.scatter_(2, write_index, k)
            past_v.scatter_(2, write_index, v)
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

    def forward(self, x, cos, sin, mask, past, write_index=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, past, write_index)
        return x + self.mlp(self.post_attention_layernorm(x))
