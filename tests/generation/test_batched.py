"""Batched decoding (issue 18): left-padded batches of 2, 3 and 4 rows equal the unpatched model's
batched greedy `generate`, token for token, on the reference loop and the runner; rows that stop
early are padded as transformers pads them; what stays unsupported raises."""

from __future__ import annotations

import pytest
import torch

import hybridspec
from hybridspec.sim.replay import DeviceReplayDrafter
from tests.models import VOCAB, qwen3_next_causal_lm, qwen35_causal_lm, qwen35_checkpoint_layout, random_drafter

MAX_NEW = 24
PAD = 0
LENGTHS = (5, 11, 2, 8)
BUILDERS = {"qwen35_causal_lm": qwen35_causal_lm, "qwen35_checkpoint_layout": qwen35_checkpoint_layout,
            "qwen3_next": qwen3_next_causal_lm}


@pytest.fixture(scope="module", params=list(BUILDERS))
def model(request):
    m = hybridspec.enable(BUILDERS[request.param](seed=len(request.param)))
    yield m
    hybridspec.disable(m)


@pytest.fixture(scope="module")
def drafter():
    return random_drafter()


def padded_batch(batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths, left-padded with PAD, and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = LENGTHS[:batch_size]
    P = max(lengths)
    ids = torch.full((batch_size, P), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, P - n:] = torch.randint(2, VOCAB, (n,), generator=g)
        mask[b, P - n:] = 1
    return ids, mask


def target_only(model, ids, mask, **kwargs) -> torch.Tensor:
    hybridspec.disable(model)
    try:
        return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **kwargs)
    finally:
        hybridspec.enable(model)


CASES = [
    # (batch size, loop, length arguments)
    (2, "reference", dict(verify_length=16)),
    (2, "runner", dict(policy="hybridspec")),
    (3, "reference", dict(policy="hybridspec")),
    (3, "runner", dict(verify_length=5)),
    (4, "reference", dict(verify_length=8)),
    (4, "runner", dict(verify_length=16)),
]


@pytest.mark.parametrize("batch_size, loop, lengths", CASES)
def test_batched_greedy_equals_target_only(model, drafter, batch_size, loop, lengths):
    ids, mask = padded_batch(batch_size, seed=batch_size)
    P = ids.shape[1]
    free = target_only(model, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None)
    # row 0 stops at its 4th token (an EOS id taken from its own continuation), the others go on
    # (or stop where they emit that id too, as they do under transformers)
    eos = int(free[0, P + 3])
    ref = target_only(model, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert (ref[0, P + 4:] == PAD).all() and ref.shape[1] > P + 4
    # simulated acceptance per row: each row drafts its own continuation, so rounds keep many drafts.
    # The replay's acceptance draws come from torch's global generator: seeded here, so that they do
    # not depend on which tests ran before in this xdist worker. Unseeded, one fresh-clone run in
    # four drew an order under which the B = 3 "hybridspec" case verified w = 2 in every round, so
    # no round could keep the two drafts checked below (seed 3 reproduces it; 0, 1, 2, 4, 5 do not)
    torch.manual_seed(0)
    replay = DeviceReplayDrafter(drafter, free[:, P:])
    loop_args = dict(reference_loop=True) if loop == "reference" else dict(enforce_eager=True)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                         pad_token_id=PAD, assistant_model=replay, hybridspec=True, return_dict_in_generate=True,
                         **loop_args, **lengths)
    assert torch.equal(out.sequences, ref)
    stats = out.hybridspec_stats
    assert stats.rounds < MAX_NEW - 1 and max(stats.accepted) >= 2
    if "verify_length" in lengths:
        # one length for the whole batch, capped only by the largest budget left
        assert stats.verify_lengths[0] == lengths["verify_length"]
    else:
        # the first round has more budget (MAX_NEW - 1 > 16) than any length: one of the set;
        # later rounds may verify the largest budget left when it is below the chosen length
        assert stats.verify_lengths[0] in {2, 4, 8, 12, 16}
        assert all(w in {2, 4, 8, 12, 16} or w < 16 for w in stats.verify_lengths)


def test_batched_dflash_drafter_and_unpadded_batch(model, drafter):
    # the real (random) drafter, every row drafting from its own masked context; and a batch
    # without padding takes the prefill of batch one
    for padded in (True, False):
        ids, mask = padded_batch(2, seed=7)
        if not padded:
            ids, mask = ids[:, -2:], mask[:, -2:]
        ref = target_only(model, ids, mask, max_new_tokens=12, eos_token_id=None)
        for loop_args in (dict(reference_loop=True), dict(enforce_eager=True)):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=PAD, assistant_model=drafter, hybridspec=True, **loop_args)
            assert torch.equal(out, ref), (padded, loop_args)


def test_padded_drafter_context_matches_the_unpadded_row(drafter):
    # a row's drafts do not depend on its left padding: masked rows and positions index - pad
    target = qwen35_causal_lm(seed=3)
    drafter.bind(target)
    feats = torch.randn(1, 5, drafter.fc.in_features)
    anchors = torch.tensor([7])
    drafter.reset(1, 64)
    drafter.observe(feats, 5)
    plain = drafter.propose(anchors)
    drafter.reset(1, 64, pad=torch.tensor([3]))
    drafter.observe(torch.cat([torch.randn(1, 3, feats.shape[-1]) * 50, feats], 1), 8)
    padded = drafter.propose(anchors)
    assert torch.equal(plain.tokens, padded.tokens)
    assert torch.allclose(plain.confidence, padded.confidence, atol=1e-5)


def test_unsupported_batches_raise(model, drafter):
    ids, mask = padded_batch(2)
    with pytest.raises(ValueError, match="batches of 1 to 4"):
        model.generate(torch.zeros(5, 4, dtype=torch.long) + 2, max_new_tokens=2, hybridspec=True,
                       assistant_model=drafter)
    with pytest.raises(ValueError, match="right .*padding"):
        model.generate(ids.flip(-1), attention_mask=mask.flip(-1), max_new_tokens=2, hybridspec=True,
                       assistant_model=drafter, pad_token_id=PAD)
    for policy in ("nominal", "no_two_stage", "dcut", "evict"):
        with pytest.raises(ValueError, match=f"policy='{policy}' is not supported for a batch of 2"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, hybridspec=True, assistant_model=drafter,
                           policy=policy, pad_token_id=PAD)
    with pytest.raises(ValueError, match="streamers only support batch size 1"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, hybridspec=True, assistant_model=drafter,
                       streamer=object(), pad_token_id=PAD)
    with pytest.raises(ValueError, match="output_scores=True is not supported .* for a batch"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, hybridspec=True, assistant_model=drafter,
                       output_scores=True, return_dict_in_generate=True, pad_token_id=PAD)
