"""Routing statistics against a set-based reference."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridspec.ops.routing import distinct_prefix_counts, new_expert_counts


def reference(ids: list[list[int]]) -> tuple[list[int], list[int]]:
    seen, counts, new = set(), [], []
    for row in ids:
        added = set(row) - seen
        seen |= added
        counts.append(len(seen))
        new.append(len(added))
    return counts, new


@settings(max_examples=40)
@given(data=st.data(), T=st.integers(1, 16), k=st.integers(1, 8), E=st.integers(8, 64), layers=st.integers(1, 3))
def test_counts_match_sets(data, T, k, E, layers):
    rows = [[data.draw(st.lists(st.integers(0, E - 1), min_size=k, max_size=k, unique=True)) for _ in range(T)]
            for _ in range(layers)]
    ids = torch.tensor(rows)  # [layers, T, k]
    counts, new = distinct_prefix_counts(ids, E), new_expert_counts(ids, E)
    for layer, r in enumerate(rows):
        want_counts, want_new = reference(r)
        assert counts[layer].tolist() == want_counts
        assert new[layer].tolist() == want_new


def test_all_rows_on_the_same_experts_add_nothing_after_the_first():
    ids = torch.tensor([[3, 5]] * 6)
    assert new_expert_counts(ids, 8).tolist() == [2, 0, 0, 0, 0, 0]
    assert distinct_prefix_counts(ids, 8).tolist() == [2] * 6
