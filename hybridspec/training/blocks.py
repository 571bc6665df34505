"""The DFlash training blocks: anchors, block inputs, labels, attention masks and loss weights.

A training sequence is `[prompt, response]`; response tokens sit at positions `start..end-1` of a
row. A block anchored at position `a` is `[x_a, mask, ..., mask]` (`W` tokens at RoPE positions
`a..a+W-1`), exactly what `DFlashDrafter.propose` drafts from when the anchor `x_a` is the newest
emitted token: its queries see the context features of positions `0..a-1` (the target has not
processed `x_a` yet) and the keys of their own block; block position `k` predicts `x_{a+k}`.

Every function is pure and vectorised; `tests/training/test_blocks.py` checks each against a loop.
"""

from __future__ import annotations

import torch

from hybridspec.drafter.layers import visibility

# gamma of the loss decay exp(-(k - 1) / gamma), as the DFlash paper sets it per block size
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The paper's gamma for its block sizes; in between, the same ratio as at block 16."""
    return PAPER_GAMMA.get(block_size, 7.0 * (block_size - 1) / 15)


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """`[W - 1]` fp32: the weight exp(-(k - 1) / gamma) of block position k = 1..W-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(start: torch.Tensor, end: torch.Tensor, length: int, num_blocks: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random anchors per row, sorted: `[B, N]` positions in `start..end-2` (each anchor
    has at least one label before `end`), and `[B, N]` bool validity (False where a row has fewer
    than N such positions; those anchors repeat `start` and must be ignored).
    `start`, `end` `[B]` long, `length` T the padded row length."""
    B = start.shape[0]
    pos = torch.arange(length, device=start.device)[None]
    allowed = (pos >= start[:, None]) & (pos <= end[:, None] - 2)
    # drawn on the host so that a seed gives the same anchors on every device
    keys = torch.rand(B, length, generator=generator).to(start.device).masked_fill(~allowed, -1.0)
    k = min(num_blocks, length)
    top, idx = keys.topk(k, dim=1)
    valid = top >= 0
    if k < num_blocks:
        pad = num_blocks - k
        idx = torch.cat([idx, idx.new_zeros(B, pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(B, pad)], 1)
    anchors = torch.where(valid, idx, start[:, None].expand(-1, num_blocks))
    # sort valid anchors first, by position, so that a row's blocks are in sequence order
    order = torch.where(valid, anchors, anchors.new_full((), length + 1)).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[B, N, W]`: RoPE positions a..a+W-1 of every block."""
    return anchors[..., None] + torch.arange(block_size, device=anchors.device)


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """`[B, N, W]`: the anchor token followed by W - 1 mask tokens."""
    first = input_ids.gather(1, anchors)[..., None]
    masks = first.new_full((*anchors.shape, block_size - 1), mask_token_id)
    return torch.cat([first, masks], dim=-1)


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, end: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels `[B, N, W - 1]` (x_{a+k} for k = 1..W-1) and their bool mask: the block is valid and
    a + k < end (tokens past a row's end are padding, never predicted)."""
    T = input_ids.shape[1]
    pos = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)
    live = valid[..., None] & (pos < end[:, None, None])
    labels = input_ids.gather(1, pos.clamp(max=T - 1).flatten(1)).view_as(pos)
    return labels, live


def attention_mask(anchors: torch.Tensor, length: int, block_size: int, causal: bool = False,
                   window: int | None = None) -> torch.Tensor:
    """Bool `[B, 1, N * W, T + N * W]`: which keys each block query sees. Keys are the T context
    positions, then the N blocks of W. A query of the block anchored at `a` sees context positions
    `p < a` and the keys of its own block, under the layer's position rule (causal, sliding window)
    as `visibility` states it for inference."""
    B, N = anchors.shape
    W = block_size
    q_pos = block_positions(anchors, W).flatten(1)  # [B, N*W]
    ctx_pos = torch.arange(length, device=anchors.device)[None].expand(B, -1)
    k_pos = torch.cat([ctx_pos, q_pos], dim=1)  # [B, T + N*W]
    q_block = torch.arange(N, device=anchors.device).repeat_interleave(W)  # [N*W]
    q_anchor = anchors.repeat_interleave(W, dim=1)  # [B, N*W]
    ctx = ctx_pos[:, None, :] < q_anchor[:, :, None]  # [B, N*W, T]
    own = (q_block[:, None] == q_block[None, :])[None].expand(B, -1, -1)  # [B, N*W, N*W]
    allowed = torch.cat([ctx, own], dim=2)[:, None]
    rule = visibility(q_pos, k_pos, causal, window)
    return allowed if rule is None else allowed & rule

