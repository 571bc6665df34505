"""The tap features of a verified block equal transformers' `hidden_states[i + 1]` for the same
positions, the last layer's (final-normed in transformers) included, as the prefill taps them."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hybridspec.patches import family_of
from hybridspec.patches.forward import allocate_state, verify_forward
from tests.helpers import assert_rel
from tests.models import VOCAB, qwen3_next_causal_lm, qwen35_causal_lm


@pytest.mark.parametrize("build", [qwen35_causal_lm, qwen3_next_causal_lm])
@torch.no_grad()
def test_block_taps_equal_transformers_hidden_states(build):
    model = build(seed=4)
    family = family_of(model)
    layers = family.text_config(model).num_hidden_layers
    taps = (layers - 1, 0, 1)
    g = torch.Generator().manual_seed(5)
    prompt, block = torch.randint(0, VOCAB, (1, 7), generator=g), torch.randint(0, VOCAB, (1, 5), generator=g)
    cache = DynamicCache(config=model.config)
    model(prompt, use_cache=True, past_key_values=cache)
    state = allocate_state(family, model, cache, 32)
    _, feats = verify_forward(family, model, block, state, taps)
    full = model(torch.cat([prompt, block], 1), output_hidden_states=True).hidden_states
    want = torch.cat([full[i + 1][:, prompt.shape[1]:] for i in taps], -1)
    assert_rel(feats, want, 1e-5, "tap features")
