"""Stage 0 + Stage 1 equals one verification forward; Stage-0 rows past w are never read."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hybridspec.patches import family_of
from hybridspec.patches.forward import allocate_state, has_router_boundary, stage0, stage1, verify_forward
from tests.helpers import assert_rel
from tests.models import TAPS, VOCAB, qwen3_next_causal_lm, qwen35_causal_lm


def fresh_state(model, prompt):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, use_cache=True, past_key_values=cache)
    return allocate_state(family_of(model), model, cache, prompt.shape[1] + 32)


@pytest.mark.parametrize("build", [qwen35_causal_lm, qwen3_next_causal_lm])
@pytest.mark.parametrize("w,u", [(2, 3), (5, 6), (7, 7), (15, 16), (1, 2)])
@torch.no_grad()
def test_split_equals_single_forward(build, w, u):
    model = build(seed=3)
    family = family_of(model)
    assert has_router_boundary(family, model)
    g = torch.Generator().manual_seed(w * 17 + u)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=g)
    tokens = torch.randint(0, VOCAB, (1, u), generator=g)
    ref_state, state = fresh_state(model, prompt), fresh_state(model, prompt)
    routing_ref, routing = [], []
    ref_hidden, ref_feats = verify_forward(family, model, tokens[:, :w], ref_state, tuple(TAPS), routing_ref)
    kept = stage0(family, model, tokens, state)
    # rows past w are Stage 0's alone: poisoning them must change nothing Stage 1 produces
    for t in kept:
        t[:, w:] = torch.nan if t.is_floating_point() else VOCAB
    hidden, feats = stage1(family, model, kept, w, state, tuple(TAPS), routing)
    assert_rel(hidden, ref_hidden, 1e-5, "hidden")
    assert_rel(feats, ref_feats, 1e-5, "tap features")
    assert all(torch.equal(a, b) for a, b in zip(routing, routing_ref)) and len(routing) == len(routing_ref)
    assert state.written == ref_state.written == w
    # the commit of any m <= w then leaves both states alike
    state.commit(torch.tensor([w]))
    ref_state.commit(torch.tensor([w]))
    assert_rel(state.gdn_states, ref_state.gdn_states, 1e-5, "committed GDN states")
    assert_rel(state.conv_windows, ref_state.conv_windows, 1e-6, "conv windows")
    for a, b in zip(state.keys, ref_state.keys):
        assert_rel(a[:, :, : int(state.length)], b[:, :, : int(ref_state.length)], 1e-6, "keys")
