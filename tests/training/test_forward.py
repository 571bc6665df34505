"""The training forward trains what inference runs: per block, its hidden states equal the stateless
forward over the context before the anchor, and its drafts equal `start` + `propose`. CPU, fp32."""

import pytest
import torch

from hybridspec.training import blocks
from hybridspec.training.forward import block_hidden, block_loss
from tests.helpers import assert_rel
from tests.models import TAPS, TEXT, VOCAB, config, qwen35_causal_lm, random_drafter

TOL = 1e-5
SLIDING = dict(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=5)
VARIANTS = {"default": {}, "causal": dict(is_causal=True), "sliding": SLIDING}


def _inputs(seed=0, B=2, T=40):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 4, (B, T), generator=gen)
    feats = torch.randn(B, T, len(TAPS) * TEXT["hidden_size"], generator=gen)
    return ids, feats, gen


@pytest.mark.parametrize("variant", VARIANTS)
def test_block_hidden_equals_inference(variant):
    drafter = random_drafter(config(**VARIANTS[variant])).bind(qwen35_causal_lm())
    ids, feats, gen = _inputs()
    B, T = ids.shape
    W = drafter.block_size
    anchors, valid = blocks.sample_anchors(torch.tensor([3, 9]), torch.tensor([T, T - 5]), T, 4, gen)
    assert valid.all()
    with torch.no_grad():
        hidden = block_hidden(drafter, feats, ids, anchors)  # [B, N, W, H]
        for b in range(B):
            for j, a in enumerate(anchors[b].tolist()):
                block = torch.tensor([[ids[b, a].item()] + [drafter.mask_token_id] * (W - 1)])
                expected = drafter(feats[b : b + 1, :a], drafter.embed(block), torch.arange(a + W)[None])
                assert_rel(hidden[b, j], expected[0], TOL, f"row {b} anchor {a}")
                # the drafting path: context = positions 0..a-1, anchor x_a at position a
                drafter.start(ids[b : b + 1, :a], feats[b : b + 1, :a])
                drafted = drafter.propose(ids[b : b + 1, : a + 1])
                probs = torch.softmax(drafter.compute_logits(hidden[b, j, 1:]), -1)
                assert drafted.tokens[0].tolist() == probs.argmax(-1).tolist()
                assert_rel(drafted.confidence[0], probs.max(-1).values, TOL, f"confidence row {b} anchor {a}")


def test_block_loss_is_the_weighted_cross_entropy():
    drafter = random_drafter(config()).bind(qwen35_causal_lm())
    ids, feats, gen = _inputs(1)
    T, W = ids.shape[1], drafter.block_size
    end = torch.tensor([T, 20])
    anchors, valid = blocks.sample_anchors(torch.tensor([5, 5]), end, T, 6, gen)
    weights = blocks.loss_weights(W, 7.0)
    loss, stats = block_loss(drafter, feats, ids, anchors, valid, end, weights)
    loss.backward()
    assert all(p.grad is not None for p in drafter.parameters())
    with torch.no_grad():
        hidden = block_hidden(drafter, feats, ids, anchors)
        num = den = 0.0
        for b in range(2):
            for j in range(6):
                if not valid[b, j]:
                    continue
                logp = torch.log_softmax(drafter.compute_logits(hidden[b, j, 1:]), -1)
                for k in range(1, W):
                    a = anchors[b, j].item()
                    if a + k < end[b]:
                        num += -logp[k - 1, ids[b, a + k]].item() * weights[k - 1].item()
                        den += weights[k - 1].item()
    assert abs(loss.item() - num / den) < 1e-4 * max(1.0, num / den)
    assert 0 <= stats["accuracy"].item() <= 1
