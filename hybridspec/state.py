"""Verification state of one request: the buffers a decoding round reads and commits.

- GDN: one fp32 `[L_gdn, B, HV, K, V]` state buffer (per-layer views), the round's compact factors
  stacked `[L_gdn, B, W, ...]`, conv windows `[L_gdn, B, C, k]` and the round's pre-conv inputs
  `[L_gdn, B, C, W]`.
- Attention: preallocated keys/values `[B, H_kv, max_len, D]` per attention layer; a round writes
  w rows at `length` and the commit advances `length` by m (stale rows are overwritten next round).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridspec.ops import GDNFactors, gdn_commit

MAX_VERIFY = 16


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
    length: int  # tokens committed to the attention caches (= the position of the next token)
    written: int = 0  # tokens the last verification wrote
    # model layer -> index into the GDN buffers / the KV lists, built once per request
    gdn_slot: dict[int, int] = field(init=False)
    attn_slot: dict[int, int] = field(init=False)

    def __post_init__(self):
        self.gdn_slot = {layer: n for n, layer in enumerate(self.gdn_layers)}
        self.attn_slot = {layer: n for n, layer in enumerate(self.attn_layers)}

    def round_factors(self, w: int) -> GDNFactors:
        """Factor buffers of a w-token round, `[Lg, B, w, ...]`, contiguous per layer (B = 1)."""
        return GDNFactors(*(f[:, :, :w] for f in self.factors))

    def commit(self, num_commit: int) -> None:
        """Keep the first `num_commit` of the `written` verified tokens in every layer."""
        w, m = self.written, num_commit
        if not 1 <= m <= w:
            raise ValueError(f"commit of {m} tokens after a round of {w}")
        device = self.gdn_states.device
        gdn_commit(self.gdn_states, self.round_factors(w), torch.full((self.gdn_states.shape[1],), m, device=device))
        k = self.conv_windows.shape[-1]
        full = torch.cat([self.conv_windows, self.conv_inputs[..., :w]], dim=-1)
        self.conv_windows.copy_(full[..., m : m + k])
        self.length += m
        self.written = 0
