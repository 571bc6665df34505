"""Prefill: transformers' own forward over the prompt with the taps the drafter reads, and the
hand-over of a request to a round's buffers (`start`)."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from hybridspec.drafter.protocol import DeviceDrafter
from hybridspec.patches.forward import load_prefill
from hybridspec.round.accept import EMPTY_MESSAGE


def prefill(model, input_ids, taps, attention_mask=None, position_ids=None):
    """Transformers' own forward over the prompt: last-position logits `[B, V]` fp32, its
    `DynamicCache`, and the tap features `[B, P, len(taps) * H]`. A left-padded batch passes the
    `attention_mask` and `position_ids` that transformers' `generate` passes to its own prefill:
    the mask zeroes the padding's GDN inputs (`apply_mask_to_padding_states`), so no padded
    position reaches a recurrent state or conv window, and attention skips the padding."""
    cache = DynamicCache(config=model.config)
    # transformers 5.24 renamed `past_key_values` to `cache` in forward signatures
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    extra = {}
    if attention_mask is not None:
        extra["attention_mask"] = attention_mask
    if position_ids is not None:
        extra["position_ids"] = position_ids
    out = model(input_ids, use_cache=True, output_hidden_states=bool(taps), logits_to_keep=1, **{name: cache}, **extra)
    feats = tap_features(out.hidden_states, taps) if taps else input_ids.new_zeros(*input_ids.shape, 0)
    return out.logits[:, -1].float(), cache, feats


def tap_features(hidden_states, taps) -> torch.Tensor:
    """The drafter's features from a transformers forward's `hidden_states`: tap i is the output of
    layer i, `hidden_states[i + 1]` (the last layer's is final-normed there), concatenated in the
    drafter's order."""
    return torch.cat([hidden_states[i + 1] for i in taps], -1)


def left_padding(attention_mask: torch.Tensor | None, batch_size: int, device) -> torch.Tensor:
    """Each row's left-padding count `[B]` (the zeros of a left-padded `attention_mask`)."""
    if attention_mask is None:
        return torch.zeros(batch_size, dtype=torch.long, device=device)
    return (attention_mask == 0).sum(-1).to(device=device, dtype=torch.long)


@torch.no_grad()
def start(target, state, drafter, input_ids: torch.Tensor, process, sampler, max_length: int,
          attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
    """The prefill hand-over of a request, for the runner and the reference loop alike: prefill,
    load `state` (in place), hand the prompt to the drafter, and choose the first token from the
    prompt's last position with the call's own rule (the bonus of a round without drafts).

    A `DeviceDrafter` is `reset` for `max_length` target positions, then observes the prompt; a host
    drafter `start`s on it. Returns the first token `[B, 1]`, its processed scores and raw logits
    `[B, V]`; raises where that position's sampled distribution is empty. `attention_mask`,
    `position_ids`: a left-padded batch's, as `generate` prepared them (None: no padding)."""
    logits, cache, feats = prefill(target.model, input_ids, target.taps, attention_mask, position_ids)
    pad = left_padding(attention_mask, input_ids.shape[0], state.pad.device)
    load_prefill(state, cache, pad)
    del cache
    if isinstance(drafter, DeviceDrafter):
        drafter.reset(input_ids.shape[0], max_length, pad)
        drafter.observe(feats, input_ids.shape[1])
    elif drafter is not None:
        drafter.start(input_ids, feats)
    no_draft = input_ids[:, :0]
    processed = process(logits[:, None], no_draft)  # [B, 1, V]
    tokens, accepted = sampler.own_rule(processed, no_draft, None)
    if bool((sampler.empty(processed, accepted) == 0).any()):
        raise RuntimeError(EMPTY_MESSAGE)
    return tokens[:, :1], processed[:, 0], logits
