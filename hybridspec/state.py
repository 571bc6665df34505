"""Verification state of one request: the buffers a decoding round reads and commits.

- GDN: one fp32 `[L_gdn, B, HV, K, V]` state buffer (per-layer views), the round's compact factors
  stacked `[L_gdn, B, W, ...]`, conv windows `[L_gdn, B, C, k]` and the round's pre-conv inputs
  `[L_gdn, B, C, W]`.
- Attention: preallocated keys/values `[B, H_kv, max_len, D]` per attention layer; a round writes
  w rows at `length` and the commit advances `length` by m (stale rows are overwritten next round).

`length` is a `[B]` device tensor (each row's committed length: the cache index of its next token)
and `commit(m)` advances each row by its own m (`[B]` on the device), so nothing here reads a length
on the host. `pad` `[B]` is each row's left padding (its first valid cache index; zeros without
padding): attention masks the cache rows before it, and a row's RoPE position is `index - pad`, as
transformers' `position_ids = cumsum(attention_mask) - 1` gives for the same padded batch. The CUDA-graph runner verifies a fixed `MAX_VERIFY` rows and sets
`num_tokens` (`[B]` device tensor, the w of the round) so that the kernels ignore rows past w; the
reference loop verifies exactly w rows (`num_tokens` None). Both commit the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from hybridspec.ops import GDNFactors, gdn_commit

MAX_VERIFY = 16


class GDNSlot(NamedTuple):
    """One GDN layer's buffers for a round of w tokens (views into `HybridState`'s stacks)."""

    state: torch.Tensor  # [B, HV, K, V] fp32, the committed state
    factors: GDNFactors  # [B, w, ...]
    window: torch.Tensor  # [B, C, k] conv window before the round
    inputs: torch.Tensor  # [B, C, W] the round's pre-conv inputs


def _leading_rows(f: torch.Tensor, w: int) -> torch.Tensor:
    """A stacked factor buffer `[Lg, B, W, ...]` as `[Lg, B, w, ...]` over each layer's first
    `B * w` rows of storage, contiguous per layer as the ops need (slicing `[:, :, :w]` is not,
    for B > 1); the verification writes and the commit reads the same view."""
    Lg, B, W, *rest = f.shape
    return f.reshape(Lg, -1)[:, : B * w * f[0, 0, 0].numel()].view(Lg, B, w, *rest)


def commit_buffers(gdn_states: torch.Tensor, factors: GDNFactors, conv_windows: torch.Tensor,
                   conv_inputs: torch.Tensor, length: torch.Tensor, num_commit: torch.Tensor) -> None:
    """`HybridState.commit` on the buffers: the GDN states from the round's factors, each conv window
    m inputs on, each row's length m on (`factors` for the `w` tokens the round wrote)."""
    gdn_commit(gdn_states, factors, num_commit)
    k, w = conv_windows.shape[-1], factors.z.shape[2]
    # the window after m more inputs is columns m .. m + k - 1 of [window, inputs]; gathered from
    # each side without the concatenation, which compiled was a kernel of its own (12 us an AR step
    # on an H100)
    index = (num_commit[:, None] + torch.arange(k, device=conv_windows.device))[None, :, None, :]
    index = index.expand(*conv_windows.shape[:-1], k)
    old = conv_windows.gather(-1, index.clamp(max=k - 1))
    new = conv_inputs[..., :w].gather(-1, (index - k).clamp(min=0, max=w - 1))
    conv_windows.copy_(torch.where(index < k, old, new))
    length += num_commit.to(length.dtype)


@dataclass
class HybridState:
    gdn_layers: list[int]
    attn_layers: list[int]
    gdn_states: torch.Tensor  # [Lg, B, HV, K, V] fp32
    factors: GDNFactors  # stacked [Lg, B, W, ...]
    conv_windows: torch.Tensor  # [Lg, B, C, k]
    conv_inputs: torch.Tensor  # [Lg, B, C, W]
    keys: list[torch.Tensor]  # per attention layer [B, Hkv, max_len, D]
    values: list[torch.Tensor]
    # per row: tokens committed to the attention caches, padding included (= the cache index of the
    # next token) [B] long
    length: torch.Tensor
    # per row: left-padding count, the first valid cache index [B] long
    pad: torch.Tensor
    written: int = 0  # tokens the last verification wrote
    # [B] rows of the round that count (None: all of them); the kernels skip the rest
    num_tokens: torch.Tensor | None = None
    # the commit's body (`commit_buffers`); the CUDA-graph runner sets a compiled copy
    # (`hybridspec.cache.compiled_copy`): eagerly it is about ten small kernels besides the GDN commit
    commit_fn: Callable = field(default=commit_buffers, repr=False)
    # model layer -> index into the GDN buffers / the KV lists, built once per request
    gdn_slot: dict[int, int] = field(init=False)
    attn_slot: dict[int, int] = field(init=False)

    def __post_init__(self):
        self.gdn_slot = {layer: n for n, layer in enumerate(self.gdn_layers)}
        self.attn_slot = {layer: n for n, layer in enumerate(self.attn_layers)}

    def round_factors(self, w: int) -> GDNFactors:
        """Factor buffers of a w-token round, `[Lg, B, w, ...]`, contiguous per layer."""
        return GDNFactors(*(_leading_rows(f, w) for f in self.factors))

    def gdn(self, layer: int, w: int) -> GDNSlot:
        """The buffers of model layer `layer` (a GDN layer) for a w-token round."""
        gi = self.gdn_slot[layer]
        return GDNSlot(self.gdn_states[gi], GDNFactors(*(_leading_rows(f, w)[gi] for f in self.factors)),
                       self.conv_windows[gi], self.conv_inputs[gi])

    def relayout(self, layer: int, u: int, w: int) -> None:
        """Layer `layer`'s factors, written for u rows, kept for the first w: move them into the
        w-row layout the commit reads (the same storage for B = 1 or w = u; a copy otherwise)."""
        B = self.gdn_states.shape[1]
        if B == 1 or w == u:
            return
        gi = self.gdn_slot[layer]
        for f in self.factors:
            kept = _leading_rows(f, u)[gi, :, :w].clone()
            _leading_rows(f, w)[gi].copy_(kept)

    def scratch(self) -> HybridState:
        """A state that shares the committed buffers (GDN states, conv windows, length) and holds
        fresh copies of the buffers a verification writes (factors, conv inputs, KV buffers): what
        a `torch.cond` branch, which may not mutate its inputs, verifies into."""
        return HybridState(
            gdn_layers=self.gdn_layers, attn_layers=self.attn_layers, gdn_states=self.gdn_states,
            factors=GDNFactors(*(f.clone() for f in self.factors)), conv_windows=self.conv_windows,
            conv_inputs=self.conv_inputs.clone(), keys=[k.clone() for k in self.keys],
            values=[v.clone() for v in self.values], length=self.length, pad=self.pad,
        )

    def commit(self, num_commit: torch.Tensor) -> None:
        """Keep the first m of the `written` verified tokens in every layer, with m `[B]` on the
        device (each row advances by its own m; m = 0 keeps a row as it is); no host read."""
        self.commit_fn(self.gdn_states, self.round_factors(self.written), self.conv_windows, self.conv_inputs,
                       self.length, num_commit)
