"""Prefill: transformers' own forward over the prompt, with the taps the drafter reads."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache


def prefill(model, input_ids, taps):
    """Transformers' own forward over the prompt: last-position logits `[B, V]` fp32, its
    `DynamicCache`, and the tap features `[B, P, len(taps) * H]`."""
    cache = DynamicCache(config=model.config)
    # transformers 5.24 renamed `past_key_values` to `cache` in forward signatures
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids, use_cache=True, output_hidden_states=bool(taps), logits_to_keep=1, **{name: cache})
    feats = torch.cat([out.hidden_states[i + 1] for i in taps], -1) if taps else input_ids.new_zeros(*input_ids.shape, 0)
    return out.logits[:, -1].float(), cache, feats
