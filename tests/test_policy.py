"""The length selector returns the brute-force argmax, ties to the shorter length."""

import itertools

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hybridspec.policy import LengthPolicy


def scores(conf: list[float], policy: LengthPolicy, max_w: int) -> dict[int, float]:
    out = {}
    for w in range(2, min(len(conf) + 1, max_w) + 1):
        p, gain = 1.0, 1.0
        for c in conf[: w - 1]:
            p *= c
            gain += p
        out[w] = gain - policy.rho * policy.cost[w - 1]
    return out


@settings(max_examples=200)
@given(conf=st.lists(st.floats(0, 1), min_size=1, max_size=15), max_w=st.integers(2, 16),
       rho=st.floats(0.1, 5), slope=st.floats(0, 0.3), bump=st.floats(-0.2, 0.2))
def test_select_is_brute_force_argmax(conf, max_w, rho, slope, bump):
    # a nonconvex cost curve: a bump in the middle
    cost = tuple(1 + slope * (w - 1) + (bump if w == 8 else 0.0) for w in range(1, 17))
    policy = LengthPolicy(cost=cost, rho=rho)
    table = scores(conf, policy, max_w)
    best = max(table.values())
    # the selector works in fp32: a runner-up within rounding of the best is a tie (tested below)
    assume(sorted(table.values())[-2:][0] < best - 1e-4 or len(table) == 1)
    got = int(policy.select(torch.tensor([conf]), max_w)[0])
    assert got == max(table, key=lambda w: (table[w], -w))


def test_ties_go_to_the_shorter_length():
    policy = LengthPolicy(cost=tuple(float(w) for w in range(1, 17)), rho=1.0)
    # every extra token adds exactly its cost: all lengths score the same
    assert int(policy.select(torch.ones(1, 15), 16)[0]) == 2


def test_budget_of_one_token_verifies_only_the_anchor():
    policy = LengthPolicy.builtin_default()
    assert int(policy.select(torch.ones(1, 15), 1)[0]) == 1
    assert all(int(policy.select(torch.full((1, 15), c), m)[0]) <= m for c, m in itertools.product([0.1, 0.9], range(2, 17)))
