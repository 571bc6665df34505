"""Checks of a `generate(..., hybridspec=True)` call's prompt, before anything runs on it."""

from __future__ import annotations

import torch


def check_input_ids(model, inputs) -> None:
    """One sequence of at least one token, every id inside the target's vocabulary (an empty prompt
    or an id past the vocabulary would otherwise fail deep inside the prefill). `inputs`: the
    call's `input_ids` (anything but a tensor is left to transformers)."""
    if not isinstance(inputs, torch.Tensor):
        return
    if inputs.dim() == 2 and inputs.shape[0] != 1:
        raise ValueError(f"hybridspec decodes one sequence at a time; got input_ids {tuple(inputs.shape)}")
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
