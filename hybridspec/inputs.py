"""Checks of a `generate(..., hybridspec=True)` call's prompt, before anything runs on it."""

from __future__ import annotations

import torch


# the largest batch hybridspec decodes (graphs are captured for 1, 2 and 4 rows)
MAX_BATCH = 4


def check_input_ids(model, inputs) -> None:
    """1..4 sequences of at least one token, every id inside the target's vocabulary (an empty
    prompt or an id past the vocabulary would otherwise fail deep inside the prefill). `inputs`:
    the call's `input_ids` (anything but a tensor is left to transformers)."""
    if not isinstance(inputs, torch.Tensor):
        return
    if inputs.dim() == 2 and not 1 <= inputs.shape[0] <= MAX_BATCH:
        raise ValueError(f"hybridspec decodes batches of 1 to {MAX_BATCH} sequences; got input_ids "
                         f"{tuple(inputs.shape)} (split the batch, e.g. pipeline(..., batch_size={MAX_BATCH}))")
    if inputs.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(inputs.shape)}): the prompt needs at least one token "
                         "(e.g. the tokenizer's BOS token)")
    if inputs.is_floating_point():
        raise ValueError(f"input_ids must hold integer token ids, got {inputs.dtype}")
    vocab = model.get_input_embeddings().weight.shape[0]
    # one host read of two numbers per call, before the prefill
    low, high = (int(v) for v in torch.aminmax(inputs))
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids holds token id {bad}, outside the target's vocabulary 0..{vocab - 1} (was the "
                         "prompt tokenized for another model?)")


def check_attention_mask(mask) -> None:
    """A batch's `attention_mask` must be left padding (zeros, then ones, per row) with at least one
    token per row: what tokenizers give with `padding_side="left"`, as batched decoding needs."""
    if not isinstance(mask, torch.Tensor) or bool(mask.all()):
        return
    if mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2D [B, P], got {tuple(mask.shape)}")
    valid = mask != 0
    # left padding: once a row's mask turns on it stays on
    if not bool((valid.long().cummax(-1).values == valid.long()).all()):
        raise ValueError("right (or inner) padding is not supported with hybridspec=True: tokenize with "
                         "padding_side='left' (tokenizer.padding_side = 'left'), as batched generation needs")
    if not bool(valid[:, -1].all()):
        raise ValueError("a row of the batch is all padding: every prompt needs at least one token")
