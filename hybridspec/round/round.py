"""`Round`: one speculative decoding round composed of the stages of `hybridspec.round.stages`,
and `ar_step`, one autoregressive token on the same buffers.

The CUDA-graph runner calls a `Round(exact=False)` inside its captured step: all `W = block_size`
rows are verified and the round's lengths (w0, w, A, m) stay on the device. The reference loop
calls a `Round(exact=True)`: after the correction it reads w on the host and verifies exactly w
rows. Both commit m = A + 1 tokens inside the round.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hybridspec.cache import compiled_copy
from hybridspec.drafter.protocol import DraftBlock, Drafter
from hybridspec.ops.dispatch import layer_options
from hybridspec.policy import Policy
from hybridspec.round import stages
from hybridspec.round.accept import first_empty, greedy_accept, greedy_accept_tokens, sample_accept
from hybridspec.round.protocols import AcceptRule, Process, Top1AcceptRule
from hybridspec.round.target import Target
from hybridspec.state import HybridState


@dataclass
class Sampler:
    """The accept rule of one call and its context-free logits processors (`warpers`, applied to
    every scored position alike: temperature, top-k, top-p, min-p). `rule` replaces the greedy or
    sampling rule in the rounds (any `AcceptRule` passed as `generate(hybridspec_accept=)`); the
    prefill's first token always takes the call's own rule."""

    do_sample: bool
    warpers: tuple = ()
    rule: AcceptRule | None = None

    @property
    def plain_greedy(self) -> bool:
        """Greedy, no warpers, the library's own rule: only each position's argmax matters."""
        return not self.do_sample and not self.warpers and self.rule is None

    @property
    def own_rule(self) -> AcceptRule:
        return sample_accept if self.do_sample else greedy_accept

    @property
    def round_rule(self) -> AcceptRule:
        return self.rule or self.own_rule

    def process(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """`[B, T, V]` fp32 -> processed scores, every position alike (a `Process`)."""
        if not self.warpers:
            return logits
        B, T, V = logits.shape
        scores = logits.reshape(B * T, V)
        # these processors read only the scores; the id argument only has to exist
        ids = torch.zeros(B * T, 1, dtype=torch.long, device=logits.device)
        for warp in self.warpers:
            scores = warp(ids, scores)
        return scores.reshape(B, T, V)

    def empty(self, processed: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """`[B]` long: the first emitted position whose sampled distribution is empty (all -inf or
        NaN), where transformers' sampler would raise; T + 1 if none or when greedy."""
        if not self.do_sample:
            return torch.full_like(accepted, processed.shape[1] + 1)
        return first_empty(processed, accepted)


def fused_head_applies(sampler: Sampler, target: Target) -> bool:
    """Whether an AR step may take its argmax from the fused head (`stages.top1_accept`): a plain
    greedy sampler, whose rule reads nothing but each position's argmax, on a plain, unsharded head
    (a round's `round_top1_rule` gives greedy's own)."""
    return round_top1_rule(sampler, target) is greedy_accept_tokens


def round_top1_rule(sampler: Sampler, target: Target):
    """The rule a round may run on the fused head's top-1 (`stages.top1_accept`), or None where it
    needs the scores: greedy's (`greedy_accept_tokens`) for a plain greedy sampler, a custom rule's
    `accept_top1` where it is a `Top1AcceptRule` (greedy, no warpers); on a plain, unsharded head."""
    if not target.plain_head or sampler.do_sample or sampler.warpers:
        return None
    if sampler.rule is None:
        return greedy_accept_tokens
    return sampler.rule.accept_top1 if isinstance(sampler.rule, Top1AcceptRule) else None


def front(policy: Policy, correction, target: Target, state: HybridState, block: DraftBlock, anchor: torch.Tensor,
          budget: torch.Tensor):
    """The round's stages between the drafts and the verification: select w0 under each row's budget,
    Stage 0 over every drafted row, and the routing correction. Returns `(cap, selection, tokens,
    kept, w, layer0)`: `cap` the budgets clamped to at least 1, `tokens` `[B, W]` the anchor and the
    drafts. One function so that the runner can compile it as one region (`Round(compile_front=True)`):
    eagerly it is about 120 small kernels (the length policy's arithmetic, the correction's counts,
    Layer 0's norm, GDN mixer and router), which inductor fuses."""
    cap = budget.clamp(min=1)
    selection = stages.select(policy, block, cap)
    tokens = torch.cat([anchor, block.tokens], dim=-1)  # [B, W]
    kept = stages.route_layer0(target, tokens, state)
    w, layer0 = stages.correct(correction, selection, kept, cap, target.num_experts)
    return cap, selection, tokens, kept, w, layer0


def compiled_front():
    """`front` compiled as one region with the layers' inductor options, on a copy of its code
    object (`hybridspec.cache.compiled_copy`: each round compiles once, however many a process
    builds)."""
    return compiled_copy(front, layer_options())


class RoundResult(NamedTuple):
    """One round on the device: the drafts, `w0`, `w`, `tokens` `[B, >= m]` (the first m = A + 1
    are emitted), `accepted` A, `empty` (`Sampler.empty`), the distinct Layer-0 experts of the
    verified tokens (-1 without Stage 0); the reference loop also keeps the raw and processed
    scores `[B, n, V]` (None under the fused head) and the routing it recorded."""

    block: DraftBlock
    w0: torch.Tensor
    w: torch.Tensor
    tokens: torch.Tensor
    accepted: torch.Tensor
    empty: torch.Tensor
    layer0: torch.Tensor
    logits: torch.Tensor | None
    processed: torch.Tensor | None
    routing: list | None


class Round:
    """The round of one (target, state, drafter, policy, sampler). `exact`: verify exactly w rows
    (one host read per round: the reference loop) instead of the fixed `W`. `record_routing`: keep
    every MoE layer's expert ids (calibration). Setting `cond` (a `hybridspec.round.cond.CondVerify`
    built for `two_stage`) verifies in per-length `torch.cond` branches instead of the fixed shape.
    `fused_head`: where the round's rule reads only each position's argmax (`round_top1_rule`: plain
    greedy, or a `Top1AcceptRule`) on a plain head, take that argmax from `stages.top1` (one pass
    over the head, no logits) instead of the logits; the result then has no scores, so the
    reference loop, which hands them to transformers, never asks for it.
    `compile_front`: run `front` (select, Stage 0, correct) compiled by `torch.compile` with the
    layers' inductor options instead of eagerly."""

    def __init__(self, target: Target, state: HybridState, drafter: Drafter, policy: Policy, sampler: Sampler,
                 exact: bool = False, record_routing: bool = False, fused_head: bool = False,
                 compile_front: bool = False):
        if record_routing and not exact:
            raise ValueError("recording routing needs the exact rows of the reference loop")
        self.target, self.state, self.drafter, self.policy, self.sampler = target, state, drafter, policy, sampler
        self.exact, self.record_routing = exact, record_routing
        self.cond = None
        device = state.gdn_states.device
        if policy.correction is not None and not target.split:
            warnings.warn(f"hybridspec: Layer 0 of this target is not GDN + sparse MoE, so policy={policy.name!r} "
                          "runs single-stage without the routing correction", stacklevel=2)
        policy.prepare(device)
        self.correction = policy.correction.to(device) if policy.correction is not None and target.split else None
        self.two_stage = target.split and policy.two_stage
        self.top1_rule = round_top1_rule(sampler, target) if fused_head else None
        self.fused_head = self.top1_rule is not None
        # fullgraph: one region; a change that breaks the trace fails at the first round instead of splitting it
        self.front = compiled_front() if compile_front else front

    @torch.no_grad()
    def __call__(self, context: torch.Tensor, budget: torch.Tensor, process: Process) -> RoundResult:
        """One round after `context[:, -1]`, the anchor; `budget` `[B]`: output tokens still allowed
        per row. A row without budget (it reached its limit, or EOS where the caller zeroed it)
        still runs, counts one row and commits nothing, so a finished row of a batch stays put."""
        state = self.state
        block = stages.draft(self.drafter, context)
        cap, selection, tokens, kept, w, layer0 = self.front(self.policy, self.correction, self.target, state, block,
                                                             context[:, -1:], budget)
        # a batch verifies one w; each row counts at most its budget (batch one: w <= budget)
        counted = torch.minimum(w, cap)
        # the reference loop's one host read of a length: it verifies exactly w rows
        rows = int(w[0]) if self.exact else None
        routing = [] if self.record_routing else None
        hidden, features = stages.verify(self.target, state, tokens, kept, counted, rows, self.two_stage, self.cond,
                                         routing)
        if self.fused_head:
            emitted, accepted, empty = stages.top1_accept(self.target, hidden, block.tokens, counted, self.top1_rule)
            logits = processed = None
        else:
            logits, processed = stages.score(self.target, hidden, block.tokens, process)
            emitted, accepted = stages.accept(self.sampler.round_rule, processed, block.tokens, counted)
            empty = self.sampler.empty(processed, accepted)
        m = torch.where(budget > 0, accepted + 1, 0)
        stages.commit(state, self.drafter, features, m)
        return RoundResult(block, selection.w0, w, emitted, accepted, empty, layer0, logits, processed, routing)


@torch.no_grad()
def ar_step(target: Target, state: HybridState, anchor: torch.Tensor, sampler: Sampler, fused_head: bool = False):
    """One autoregressive token after `anchor` `[B, 1]`: verify it alone, accept, commit. Returns
    `(tokens [B, 1], accepted [B] (zeros), empty [B])`. `fused_head`: take the argmax from the
    fused head, where the caller found that `fused_head_applies` (once, not every step)."""
    hidden, _ = stages.verify(target, state, anchor, None, None, 1, False)
    if fused_head:
        emitted, accepted, empty = stages.top1_accept(target, hidden, anchor[:, :0], None)
    else:
        _, processed = stages.score(target, hidden, anchor[:, :0], sampler.process)
        emitted, accepted = stages.accept(sampler.own_rule, processed, anchor[:, :0], None)
        empty = sampler.empty(processed, accepted)
    stages.commit(state, None, hidden[..., :0], accepted + 1)
    return emitted, accepted, empty
