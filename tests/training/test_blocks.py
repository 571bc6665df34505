"""Anchors, block inputs, labels, attention masks and loss weights against naive loops."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridspec.training import blocks

MASK = 99


@st.composite
def rows(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(4, 40))
    start = [draw(st.integers(0, T - 2)) for _ in range(B)]
    end = [draw(st.integers(s + 1, T)) for s in start]
    return T, torch.tensor(start), torch.tensor(end)


@settings(max_examples=40)
@given(rows(), st.integers(1, 12), st.integers(0, 2**16))
def test_anchors_distinct_sorted_in_range(r, N, seed):
    T, start, end = r
    anchors, valid = blocks.sample_anchors(start, end, T, N, torch.Generator().manual_seed(seed))
    assert anchors.shape == valid.shape == (len(start), N)
    for b in range(len(start)):
        room = max(0, int(end[b]) - 1 - int(start[b]))  # positions start..end-2
        live = anchors[b][valid[b]].tolist()
        assert valid[b].sum().item() == min(N, room)
        assert live == sorted(set(live)), "valid anchors are distinct and sorted"
        assert all(start[b] <= a <= end[b] - 2 for a in live)
        assert valid[b].tolist() == sorted(valid[b].tolist(), reverse=True), "valid anchors come first"


def test_anchors_are_seeded_and_cover_the_range():
    start, end = torch.tensor([2]), torch.tensor([30])
    draw = lambda s: blocks.sample_anchors(start, end, 32, 5, torch.Generator().manual_seed(s))[0]
    assert torch.equal(draw(1), draw(1))
    seen = set()
    for s in range(200):
        seen.update(draw(s)[0].tolist())
    assert seen == set(range(2, 29))


@settings(max_examples=30)
@given(rows(), st.integers(2, 8), st.integers(1, 4), st.booleans(), st.one_of(st.none(), st.integers(1, 6)),
       st.integers(0, 2**16))
def test_inputs_labels_and_mask_match_a_loop(r, W, N, causal, window, seed):
    T, start, end = r
    gen = torch.Generator().manual_seed(seed)
    B = len(start)
    ids = torch.randint(0, 50, (B, T), generator=gen)
    anchors, valid = blocks.sample_anchors(start, end, T, N, gen)
    inputs = blocks.block_input_ids(ids, anchors, W, MASK)
    pos = blocks.block_positions(anchors, W)
    labels, live = blocks.block_labels(ids, anchors, valid, end, W)
    mask = blocks.attention_mask(anchors, T, W, causal, window)
    assert mask.shape == (B, 1, N * W, T + N * W)
    for b in range(B):
        for j in range(N):
            a = anchors[b, j].item()
            assert inputs[b, j].tolist() == [ids[b, a].item()] + [MASK] * (W - 1)
            assert pos[b, j].tolist() == list(range(a, a + W))
            for k in range(1, W):
                expect_live = bool(valid[b, j]) and a + k < end[b]
                assert live[b, j, k - 1].item() == expect_live
                if expect_live:
                    assert labels[b, j, k - 1].item() == ids[b, a + k].item()
            for k in range(W):
                q = a + k
                row = mask[b, 0, j * W + k]

                def rule(kp):
                    ok = not causal or kp <= q
                    if window is not None:
                        ok = ok and q - kp < window and (causal or kp - q < window)
                    return ok

                for p in range(T):
                    assert row[p].item() == (p < a and rule(p)), (b, j, k, p)
                for j2 in range(N):
                    for k2 in range(W):
                        expect = j2 == j and rule(anchors[b, j2].item() + k2)
                        assert row[T + j2 * W + k2].item() == expect, (b, j, k, j2, k2)


def test_loss_weights_follow_the_paper():
    w = blocks.loss_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0].item() == 1.0
    assert all(math.isclose(w[k - 1].item(), math.exp(-(k - 1) / 7), rel_tol=1e-6) for k in range(1, 16))
    assert blocks.default_gamma(16) == 7.0 and blocks.default_gamma(8) == 4.0


def test_schedule_and_time_budget():
    from hybridspec.training.train import _schedule, planned_steps

    factor, total = _schedule(0.1)
    total[0] = 100
    assert [round(factor(s), 3) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert factor(10) == 1.0 and abs(factor(55) - 0.5) < 1e-9 and factor(100) == 0.0
    # 30 steps done after 5 s of a 200 s budget at 0.025 s per steady step
    assert planned_steps(100_000, 200.0, 5.0, 0.025, 30) == 30 + 7800
    assert planned_steps(1000, 200.0, 5.0, 0.025, 30) == 1000
    assert planned_steps(1000, 200.0, 250.0, 0.025, 30) == 30


def test_default_taps_leave_out_the_last_layer():
    from hybridspec.training.train import default_taps

    assert default_taps(4) == [0, 1, 2]
    assert default_taps(2) == [0]
    taps = default_taps(40)
    assert len(taps) == 5 and taps[0] == 0 and taps[-1] == 38
