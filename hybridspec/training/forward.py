"""The batched, differentiable training forward of a `DFlashDrafter` over many blocks at once.

It runs the drafter's own modules (`fc`, `hidden_norm`, `layers`, `norm`, `rotary_emb`, the bound
target's embedding and head), so the trained weights are exactly what inference loads. Per layer,
the context keys/values of all T positions are computed once (`context_kv`, as `observe` does) and
the N blocks of a row attend to them through `blocks.attention_mask`: a block anchored at `a` sees
positions `0..a-1` and its own keys, at RoPE positions `a..a+W-1`, which is what `propose` sees
when the drafter's context length is `a` (`tests/training/test_forward.py` checks the equality).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridspec.training import blocks


def block_hidden(drafter, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states `[B, N, W, H]` of the blocks anchored at `anchors` `[B, N]`.
    `features` `[B, T, n_taps * H]`: the target's taps at every position of `input_ids` `[B, T]`."""
    (B, T), N, W = input_ids.shape, anchors.shape[1], drafter.block_size
    ctx = drafter.hidden_norm(drafter.fc(features.to(drafter.fc.weight.dtype)))  # [B, T, H]
    ids = blocks.block_input_ids(input_ids, anchors, W, drafter.mask_token_id)
    h = drafter.embed(ids.flatten(1))  # [B, N*W, H]
    cos_c, sin_c = drafter.rotary_emb(ctx, torch.arange(T, device=ctx.device)[None].expand(B, -1))
    cos_b, sin_b = drafter.rotary_emb(h, blocks.block_positions(anchors, W).flatten(1))
    kinds = {(layer.self_attn.is_causal, layer.self_attn.sliding_window) for layer in drafter.layers}
    masks = {kind: blocks.attention_mask(anchors, T, W, *kind) for kind in kinds}
    for layer in drafter.layers:
        attn = layer.self_attn
        past = attn.context_kv(ctx, cos_c, sin_c)
        h = layer(h, cos_b, sin_b, masks[attn.is_causal, attn.sliding_window], past)
    return drafter.norm(h).view(B, N, W, -1)


def block_loss(drafter, features, input_ids, anchors, valid, end, weights) -> tuple[torch.Tensor, dict]:
    """The DFlash loss: cross-entropy of block position k against x_{a+k}, weighted by `weights`
    `[W - 1]`, averaged over the live labels' weights. Also returns fp32 diagnostics: weighted
    accuracy and the accuracy of position 1."""
    hidden = block_hidden(drafter, features, input_ids, anchors)[:, :, 1:]
    labels, live = blocks.block_labels(input_ids, anchors, valid, end, drafter.block_size)
    logits = drafter.compute_logits(hidden).float()  # [B, N, W-1, V]
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    w = weights.to(ce.device)[None, None] * live
    total = w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels).float()
        stats = {"accuracy": (hit * w).sum() / total,
                 "accuracy@1": (hit[..., 0] * live[..., 0]).sum() / live[..., 0].sum().clamp(min=1)}
    return (ce * w).sum() / total, stats
