"""Random MoE-experts inputs for the op tests: routings that share, repeat and concentrate experts,
and rows past `num_tokens` that hold NaN and garbage expert ids."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

ROUTINGS = ("random", "shared", "one_expert", "repeat")


@dataclass(frozen=True)
class MoECase:
    T: int
    K: int
    E: int
    H: int
    I: int
    dtype: torch.dtype
    routing: str
    # num_tokens; None: all rows
    n: int | None
    seed: int


def _route(case: MoECase, gen: torch.Generator) -> torch.Tensor:
    T, K, E = case.T, case.K, case.E

    def perm(m):
        return torch.randperm(m, generator=gen)

    # k distinct experts per row, as a router's top-k gives
    if case.routing == "random":
        return torch.stack([perm(E)[:K] for _ in range(T)])
    # every row picks the same k experts, in its own order
    if case.routing == "shared":
        chosen = perm(E)[:K]
        return torch.stack([chosen[perm(K)] for _ in range(T)])
    # every row has expert e0 among its k
    if case.routing == "one_expert":
        e0 = int(torch.randint(E, (1,), generator=gen))
        others = [e for e in range(E) if e != e0]
        rows = []
        for _ in range(T):
            row = torch.tensor([e0] + [others[i] for i in perm(E - 1)[: K - 1].tolist()])
            rows.append(row[perm(K)])
        return torch.stack(rows)
    # "repeat": drawn with replacement, so a row may name an expert twice (counted twice)
    return torch.randint(E, (T, K), generator=gen)


def make_inputs(case: MoECase, device: str):
    """`hidden, topk_ids, topk_weights, gate_up_proj, down_proj, num_tokens` on `device`.

    Rows at or past `case.n` hold NaN hidden states and weights and garbage ids (out of range,
    negative, huge, or valid-looking).
    """
    gen = torch.Generator().manual_seed(case.seed)
    T, K, E, H, I = case.T, case.K, case.E, case.H, case.I
    hidden = torch.randn(T, H, generator=gen)
    ids = _route(case, gen)
    weights = torch.rand(T, K, generator=gen) + 0.1
    gate_up = torch.randn(E, 2 * I, H, generator=gen) * H**-0.5
    down = torch.randn(E, H, I, generator=gen) * I**-0.5
    num_tokens = None
    if case.n is not None:
        garbage = torch.tensor([E, E + 3, -1, -7, 2**40, -(2**40), 0, E - 1])
        pick = torch.randint(len(garbage), (T, K), generator=gen)
        past = torch.arange(T)[:, None] >= case.n
        ids = torch.where(past, garbage[pick], ids)
        hidden[case.n:] = float("nan")
        weights[case.n:] = float("nan")
        num_tokens = torch.tensor([case.n])
    hidden, gate_up, down, weights = (x.to(case.dtype) for x in (hidden, gate_up, down, weights))
    out = (hidden, ids, weights, gate_up, down, num_tokens)
    return tuple(None if x is None else x.to(device) for x in out)


@st.composite
def moe_cases(draw, max_tokens=16, dtypes=(torch.float32, torch.bfloat16), with_num_tokens=True):
    K = draw(st.sampled_from([1, 2, 8]), label="k")
    T = draw(st.integers(1, max_tokens), label="T")
    n = None
    if with_num_tokens and draw(st.booleans(), label="has num_tokens"):
        n = draw(st.integers(0, T), label="num_tokens")
    return MoECase(
        T=T,
        K=K,
        E=draw(st.integers(max(4, K), 16), label="E"),
        H=draw(st.sampled_from([32, 48, 64]), label="H"),
        I=draw(st.sampled_from([16, 32, 48]), label="I"),
        dtype=draw(st.sampled_from(dtypes), label="dtype"),
        routing=draw(st.sampled_from(ROUTINGS), label="routing"),
        n=n,
        seed=draw(st.integers(0, 2**31 - 1), label="seed"),
    )


def make_shared(case: MoECase, device: str):
    """A shared expert for `case`: `(gate_up [2I, H], down [H, I], gate logits [T, 1])`, the logits a
    strided column of a wider output (as the block's fused GEMM gives them), NaN past `case.n`."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    T, H, I = case.T, case.H, case.I
    gate_up = torch.randn(2 * I, H, generator=gen) * H**-0.5
    down = torch.randn(H, I, generator=gen) * I**-0.5
    logits = torch.randn(T, 5, generator=gen) * 2
    if case.n is not None:
        logits[case.n:] = float("nan")
    gate_up, down, logits = (x.to(case.dtype).to(device) for x in (gate_up, down, logits))
    return gate_up, down, logits[:, 3:4]
