"""The stages of one decoding round (docs/design.md, "One round"), shared by the CUDA-graph
runner and the reference loop. Every length is a `[B]` device tensor; no stage reads one on the
host. The reference loop reads w once, after `correct`, to verify exactly w rows; the runner
verifies a fixed `W` rows and the kernels skip the rows past w (`HybridState.num_tokens`).

    draft -> select -> stage0 -> correct -> verify (Stage 1, or one forward) -> score -> accept -> commit
"""

from __future__ import annotations

import torch

from hybridspec import parallel
from hybridspec.drafter.protocol import DraftBlock, Drafter
from hybridspec.ops import lm_head_top1
from hybridspec.ops.routing import distinct_prefix_counts
from hybridspec.patches.forward import Stage0, stage0, stage1, verify_forward
from hybridspec.policy import Correction, Policy, Selection
from hybridspec.round.accept import greedy_accept_tokens
from hybridspec.round.protocols import AcceptRule, Process
from hybridspec.round.target import Target
from hybridspec.state import HybridState


def draft(drafter: Drafter, context: torch.Tensor) -> DraftBlock:
    """d_1..d_D after the anchor `context[:, -1]` (the runner passes the `[B, 1]` anchors, the
    reference loop the whole host sequence, which a host drafter reads)."""
    return drafter.propose(context)


def select(policy: Policy, block: DraftBlock, budget: torch.Tensor) -> Selection:
    """The nominal length w0 `[B]`, at most `budget` (output tokens still allowed)."""
    return policy.select(block, budget)


def route_layer0(target: Target, tokens: torch.Tensor, state: HybridState) -> Stage0 | None:
    """Stage 0 over every row of `tokens` `[B, W]`: embedding, Layer-0 GDN and the Layer-0 router,
    stopping before any routed expert; None where Layer 0 has no router boundary. Only the first w
    rows' factors are ever committed, and those depend on the first w tokens alone."""
    if not target.split:
        return None
    state.num_tokens = None
    return stage0(target.family, target.model, tokens, state, target.blocks)


def correct(correction: Correction | None, selection: Selection, kept: Stage0 | None, cap: torch.Tensor,
            num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The verified length w `[B]` (w0, or longer where the routing correction keeps extra tokens)
    and the distinct Layer-0 experts its w tokens route to (`[B]`, -1 without Stage 0). `cap` `[B]`:
    each row's budget (at least 1)."""
    w0 = selection.w0
    if kept is None:
        return w0, torch.full_like(w0, -1)
    # counted once per round: the correction reads the same counts
    distinct = distinct_prefix_counts(kept.topk_ids, num_experts)  # [B, W]
    w = w0 if correction is None else correction.extend(selection, kept.topk_ids, cap, num_experts, distinct)
    return w, distinct.gather(1, (torch.minimum(w, cap) - 1)[:, None])[:, 0]


def verify(target: Target, state: HybridState, tokens: torch.Tensor, kept: Stage0 | None, w: torch.Tensor,
           rows: int | None, two_stage: bool, cond=None, routing: list | None = None):
    """Final-norm hidden states and tap features of the verified rows. `rows`: None for the fixed
    shape (all `W` rows of `tokens`, the kernels skip those past w), or the host's w (exactly w
    rows). Resumes at Layer 0's experts after `kept` when `two_stage`, else verifies from the
    embedding. `cond`: the per-length `torch.cond` dispatch (`hybridspec.round.cond`)."""
    n = tokens.shape[1] if rows is None else rows
    state.num_tokens = w if rows is None else None
    if cond is not None:
        return cond(w, *kept) if kept is not None and two_stage else cond(w, tokens)
    if kept is not None and two_stage:
        return stage1(target.family, target.model, kept, n, state, target.taps, routing, blocks=target.blocks)
    return verify_forward(target.family, target.model, tokens[:, :n], state, target.taps, routing,
                          blocks=target.blocks)


def score(target: Target, hidden: torch.Tensor, drafts: torch.Tensor, process: Process):
    """fp32 logits `[B, n, V]` of the verified rows and the processed scores the accept rule reads."""
    # a tensor-parallel head is split over the vocabulary: every rank gathers all of it
    logits = parallel.column(target.lm_head, hidden, gather=True).float()
    return logits, process(logits, drafts)


def top1(target: Target, hidden: torch.Tensor) -> torch.Tensor:
    """The head's argmax `[B, n]` of the verified rows in one pass over its weight
    (`hybridspec.ops.lm_head_top1`), without the `[B, n, V]` logits: for plain greedy rounds on a
    `Target.plain_head`. It is `torch.argmax` of the logits in the head's dtype, summed in the
    kernel's order (a near-tie can go the other way than after cuBLAS, as between two GEMMs)."""
    B, n, H = hidden.shape
    tokens, _, _ = lm_head_top1(hidden.reshape(B * n, H), target.lm_head.weight)
    return tokens.view(B, n)


def top1_accept(target: Target, hidden: torch.Tensor, drafts: torch.Tensor, w: torch.Tensor | None,
                rule=greedy_accept_tokens):
    """Score and accept in one: `(tokens, accepted, empty)` from `top1` and `rule(best, drafts, w)`
    (greedy's, or a `Top1AcceptRule`'s `accept_top1`), as `score` then `accept` give them for a rule
    that reads only the argmax (`empty` is greedy's: past every position)."""
    emitted, accepted = rule(top1(target, hidden), drafts, w)
    return emitted, accepted, torch.full_like(accepted, hidden.shape[1] + 1)


def accept(rule: AcceptRule, processed: torch.Tensor, drafts: torch.Tensor, w: torch.Tensor | None):
    """`(tokens [B, >= w], accepted [B])`: the first A drafts kept, then the token after them."""
    return rule(processed, drafts, w)


def commit(state: HybridState, drafter: Drafter | None, features: torch.Tensor, m: torch.Tensor) -> None:
    """Keep m = A + 1 verified tokens in every layer and in the drafter's context."""
    state.commit(m)
    if drafter is not None:
        drafter.observe(features, m)
