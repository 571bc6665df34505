"""One decoding round at a fixed shape, every length on the device (DESIGN.md section 2).

`spec_round` always drafts, verifies and scores `W = block_size` rows; the round's own lengths
(`w0`, `w`, `A`, `m`) are device tensors that the kernels read: the GDN ops skip rows past w
(`num_tokens`), the MoE op reads only the experts of rows before w, attention masks by position,
and the commit advances by m. So one captured graph serves every length and nothing is read on the
host. `ar_step` is autoregressive decoding (w = 1, no drafter) on the same buffers.

Each step writes its result to `io.out` `[B, T + 5]`: the T tokens of the round (the first m are
emitted), then m, w, w0, the first emitted position whose sampled distribution was empty (T + 1
if none; the host raises on reaching it, as transformers' sampler would) and the distinct Layer-0
experts the w verified tokens routed to (-1 where Layer 0 has no router boundary).

Where Layer 0 is GDN + sparse MoE every round runs as Stage 0 + Stage 1 (the same arithmetic as
one forward, `tests/generation/test_two_stage.py`), so the Layer-0 routing is at hand for the
correction and the statistics.

`dispatch="cond"` verifies the w rows in per-length `torch.cond` branches instead
(`hybridspec/runner/cond.py`): the same outputs, but no CUDA graph on torch 2.11.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.generation.accept import first_empty, greedy_accept, sample_accept
from hybridspec.ops.routing import distinct_prefix_counts
from hybridspec.patches.forward import EAGER, Blocks, has_router_boundary, stage0, stage1, verify_forward
from hybridspec.runner.cond import CondVerify
from hybridspec.state import HybridState

# columns of `io.out` after the tokens
M, W_COL, W0_COL, EMPTY_COL, L0_COL = range(5)
EXTRA = 5


@dataclass
class RoundIO:
    """Static buffers between the host and the steps (batch one)."""

    anchor: torch.Tensor  # [B, 1] long: x_0, the newest token the target has not processed
    budget: torch.Tensor  # [B] long: output tokens still allowed after the anchor
    out: torch.Tensor  # [B, T + EXTRA] long

    @classmethod
    def allocate(cls, width: int, device) -> RoundIO:
        return cls(torch.zeros(1, 1, dtype=torch.long, device=device), torch.ones(1, dtype=torch.long, device=device),
                   torch.zeros(1, width + EXTRA, dtype=torch.long, device=device))


@dataclass
class Sampler:
    """The accept rule and the context-free logits processors of one call (`warpers`: applied to
    each scored position alike, e.g. temperature, top-k, top-p)."""

    do_sample: bool
    warpers: tuple = ()
    # an `AcceptRule` replacing the greedy / sampling rule of the rounds (simulation only)
    rule: object = None

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """`[B, T, V]` fp32 -> processed scores, every position alike."""
        if not self.warpers:
            return logits
        B, T, V = logits.shape
        scores = logits.reshape(B * T, V)
        # these processors read only the scores; the id argument only has to exist
        ids = torch.zeros(B * T, 1, dtype=torch.long, device=logits.device)
        for warp in self.warpers:
            scores = warp(ids, scores)
        return scores.reshape(B, T, V)

    def accept(self, processed, draft, num_tokens):
        rule = self.rule or (sample_accept if self.do_sample else greedy_accept)
        return rule(processed, draft, num_tokens)

    def empty(self, processed: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """`[B]` long: the first emitted position with an empty distribution when sampling, else T + 1."""
        if not self.do_sample:
            return torch.full_like(accepted, processed.shape[1] + 1)
        return first_empty(processed, accepted)


class RoundProgram:
    """The steps of one (target, drafter, policy, sampler) combination over one `HybridState`
    whose `length` is a `[1]` device tensor. `dispatch`: "fixed" (verify all rows, kernels skip
    those past w) or "cond" (per-length `torch.cond` branches)."""

    def __init__(self, family, model, state: HybridState, io: RoundIO, sampler: Sampler, drafter=None, policy=None,
                 blocks: Blocks = EAGER, dispatch: str = "fixed"):
        self.family, self.model, self.state, self.io, self.sampler = family, model, state, io, sampler
        self.blocks = blocks
        self.drafter, self.policy = drafter, policy
        self.lm_head = model.get_output_embeddings()
        self.taps = tuple(drafter.target_layer_ids) if drafter is not None else ()
        self.correction = None
        self.split = has_router_boundary(family, model)
        if self.split:
            self.num_experts = family.text_model(model).layers[0].mlp.gate.weight.shape[0]
        if policy is not None and getattr(policy, "correction", None) is not None and self.split:
            self.correction = policy.correction.to(state.gdn_states.device)
        acceptance = getattr(policy, "acceptance", None)
        if acceptance is not None:
            acceptance.prepare(state.gdn_states.device)
        self.two_stage = self.split and getattr(policy, "two_stage", True)
        self.cond = None
        if dispatch == "cond":
            self.cond = CondVerify(family, model, state, self.taps, drafter.block_size, self.two_stage)

    @torch.no_grad()
    def spec_round(self) -> None:
        """draft -> select -> stage 0 -> correction -> stage 1 (or one forward) -> accept -> commit."""
        io, state = self.io, self.state
        block = self.drafter.propose(io.anchor[:, 0])
        W = block.tokens.shape[1] + 1
        cap = io.budget.clamp(min=1)
        choice = self.policy.select(block, cap)
        w0 = choice.w0
        tokens = torch.cat([io.anchor, block.tokens], dim=-1)  # [B, W]
        state.num_tokens = None
        if not self.split:
            w = w0
            state.num_tokens = w
            hidden, feats = self._verify(w, None, tokens)
            layer0 = torch.full_like(w, -1)
        else:
            kept = stage0(self.family, self.model, tokens, state)
            distinct = distinct_prefix_counts(kept.topk_ids, self.num_experts)  # [B, W]
            w = w0
            if self.correction is not None:
                # token w0 + 1 against the union of the first w0: entry w0 of the new-expert counts
                at = w0.clamp(1, W - 1)[:, None]
                n_new = (distinct.gather(1, at) - distinct.gather(1, at - 1))[:, 0]
                extra = self.correction.keep_extra(choice.prefix, w0, n_new) & (w0 < cap)
                w = w0 + extra.long()
            state.num_tokens = w
            layer0 = distinct.gather(1, (w - 1)[:, None])[:, 0]
            hidden, feats = self._verify(w, kept, tokens)
        processed = self.sampler.process(self.lm_head(hidden).float())  # [B, W, V]
        emitted, accepted = self.sampler.accept(processed, block.tokens, w)
        m = accepted + 1
        state.commit_static(m)
        self.drafter.observe(feats, m)
        self._finish(emitted, accepted, w, w0, processed, layer0)

    def _verify(self, w: torch.Tensor, kept, tokens: torch.Tensor):
        """The verification of the round's rows: Stage 1 after `kept` where the round runs two
        stages, else the whole stack on `tokens`; per-length branches under `dispatch="cond"`."""
        W = tokens.shape[1]
        if self.cond is not None:
            return self.cond(w, *kept) if self.two_stage else self.cond(w, tokens)
        if self.two_stage:
            return stage1(self.family, self.model, kept, W, self.state, self.taps, blocks=self.blocks)
        return verify_forward(self.family, self.model, tokens, self.state, self.taps, blocks=self.blocks)

    @torch.no_grad()
    def ar_step(self) -> None:
        """One autoregressive token: verify the anchor alone, accept, commit it."""
        io, state = self.io, self.state
        state.num_tokens = None
        hidden, _ = verify_forward(self.family, self.model, io.anchor, state, blocks=self.blocks)
        processed = self.sampler.process(self.lm_head(hidden).float())  # [B, 1, V]
        rule = sample_accept if self.sampler.do_sample else greedy_accept
        emitted, accepted = rule(processed, io.anchor[:, :0], None)
        one = accepted + 1
        state.commit_static(one)
        self._finish(emitted, accepted, one, one, processed, torch.full_like(one, -1))

    def _finish(self, emitted, accepted, w, w0, processed, layer0) -> None:
        io = self.io
        io.anchor.copy_(emitted.gather(1, accepted[:, None]))
        io.budget.sub_(accepted + 1)
        empty = self.sampler.empty(processed, accepted)
        io.out.copy_(torch.cat([emitted, torch.stack([accepted + 1, w, w0, empty, layer0], dim=-1)], dim=-1))
