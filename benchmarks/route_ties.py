"""Does `route_topk` choose the experts CUDA's `torch.topk` chooses? The evidence behind wiring it
into the router (`hybridspec/patches/common.py: route_logits`).

bf16 router logits tie often (8 bits of mantissa over 256 or 512 experts). For each router shape
(E = 256 top-8: Qwen3.5/3.6 and the 122B; E = 512 top-10: Qwen3-Next) and logit scale, 65,536 rows
of Gaussian logits: the rows where our ids equal `torch.topk`'s in order and as a set, the rows with
a tie at the k-th place (where a different tie rule would choose another expert) and inside the
top k (where only the slot order can differ), whether `torch.topk` orders tied values by index, and
the rows whose weight per expert is bitwise equal to transformers' (softmax, topk, renormalise,
cast). Acceptance: not applicable (no decoding).

    python benchmarks/route_ties.py [--out bench_out/route_ties.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import env_info, write_json  # noqa: E402
from hybridspec.ops import route_topk  # noqa: E402

ROWS = 65536
SHAPES = [(256, 8), (512, 10)]
SCALES = [0.3, 1.0, 3.0]
# the most rows one router call sees (B x w <= 4 x 16); aten takes another top-k kernel (multi-block)
# for over 4,000 rows of 400 or more values, so the reference runs in calls of this many rows
CALL_ROWS = 64


def transformers_router_tail(logits: torch.Tensor, k: int):
    probs = torch.softmax(logits, -1, dtype=torch.float)
    top, ids = (torch.cat(t) for t in zip(*(torch.topk(p, k, dim=-1) for p in probs.split(CALL_ROWS))))
    return (top / top.sum(-1, keepdim=True)).to(logits.dtype), ids, probs


def per_expert(ids: torch.Tensor, weights: torch.Tensor, E: int) -> torch.Tensor:
    return torch.zeros(ids.shape[0], E, device=ids.device).scatter_(1, ids, weights.float())


def case(E: int, k: int, scale: float, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> dict:
    logits = (torch.randn(ROWS, E, device="cuda", generator=gen) * scale).to(dtype)
    weights, ids = route_topk(logits, k)
    ref_w, ref_ids, probs = transformers_router_tail(logits, k)
    ranked = probs.sort(-1, descending=True).values
    boundary_tie = ranked[:, k - 1] == ranked[:, k]
    inner_tie = (ranked[:, : k - 1] == ranked[:, 1:k]).any(-1)
    same_order = (ids == ref_ids).all(-1)
    same_set = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
    # torch.topk's order among equal values: rows whose tied slots come in ascending index
    top = probs.gather(1, ref_ids)
    tied_pair = top[:, :-1] == top[:, 1:]
    descending_ids = ref_ids[:, :-1] > ref_ids[:, 1:]
    ascending = ~(tied_pair & descending_ids).any(-1)
    return {
        "E": E, "k": k, "logit_scale": scale, "dtype": str(dtype), "rows": ROWS, "reference_rows_per_call": CALL_ROWS,
        "same_ids_in_order": int(same_order.sum()),
        "same_ids_as_set": int(same_set.sum()),
        "rows_tied_at_kth_place": int(boundary_tie.sum()),
        "rows_tied_inside_top_k": int(inner_tie.sum()),
        "set_differs_where_tied_at_kth_place": int((~same_set & boundary_tie).sum()),
        "order_differs_without_tie_inside": int((~same_order & ~inner_tie).sum()),
        "torch_topk_ties_in_ascending_index": f"{int((ascending & inner_tie).sum())}/{int(inner_tie.sum())}",
        "weight_per_expert_bitwise_equal_rows": int((per_expert(ids, weights, E) == per_expert(ref_ids, ref_w, E)).all(-1).sum()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out/route_ties.json")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = {"env": env_info(), "acceptance": "not applicable (no decoding)",
              "cases": [case(E, k, s, gen) for E, k in SHAPES for s in SCALES]
              + [case(E, k, 1.0, gen, torch.float32) for E, k in SHAPES]}
    for c in report["cases"]:
        print(c)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
