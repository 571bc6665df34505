"""The select and verify stages of a round: choose the length, run the target over the block.

With a routing-corrected policy (DESIGN.md section 2, steps 2-5): Stage 0 runs `u = min(w0 + 1,
w_rem, W)` tokens up to the Layer-0 router; the correction counts the Layer-0 experts that token u
adds to the union of the first w0 and decides between w0 and w0 + 1; Stage 1 resumes at Layer 0's
experts for the chosen w. Every other policy verifies its w0 tokens in one forward.

The eager loop slices by w, so it reads w on the host here; the CUDA-graph runner (issue 6) keeps
it on the device.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hybridspec.drafter.protocol import DraftBlock
from hybridspec.ops.routing import new_expert_counts
from hybridspec.patches.forward import has_router_boundary, stage0, stage1, verify_forward
from hybridspec.state import HybridState


class Verified(NamedTuple):
    """One round's verification: the policy's `w0`, the verified length `w`, the final-norm hidden
    states `[B, w, H]`, the tap features `[B, w, taps * H]`, the drafts it covered `[B, w - 1]`, and
    (when recorded) every sparse MoE layer's expert ids `[B, w, k]` in layer order."""

    w0: int
    w: int
    hidden: torch.Tensor
    features: torch.Tensor
    draft: torch.Tensor
    routing: list | None


@dataclass
class Verifier:
    family: object
    model: torch.nn.Module
    state: HybridState
    policy: object
    taps: tuple[int, ...]
    # calibration reads the routing of every verified block
    record_routing: bool = False

    def __post_init__(self):
        self.correction = getattr(self.policy, "correction", None)
        if self.correction is not None and not has_router_boundary(self.family, self.model):
            warnings.warn(f"hybridspec: Layer 0 of this target is not GDN + sparse MoE, so policy="
                          f"{self.policy.name!r} runs single-stage without the routing correction")
            self.correction = None
        if self.correction is not None:
            layer0 = self.family.text_model(self.model).layers[0]
            self.num_experts = layer0.mlp.gate.weight.shape[0]
            self.correction = self.correction.to(self.state.gdn_states.device)

    def __call__(self, anchor: torch.Tensor, block: DraftBlock, remaining: int) -> Verified:
        choice = self.policy.select(block, remaining)
        w = w0 = int(choice.w0[0])
        tokens = torch.cat([anchor, block.tokens], dim=-1)
        routing = [] if self.record_routing else None
        u = min(w0 + 1, remaining, tokens.shape[1])
        kept = None
        if self.correction is not None and u > w0:
            kept = stage0(self.family, self.model, tokens[:, :u], self.state)
            # token u = w0 + 1 against the union of the first w0: the last entry of the new-expert counts
            n_new = new_expert_counts(kept.topk_ids, self.num_experts)[:, u - 1]
            w += int(self.correction.keep_extra(choice.prefix, choice.w0, n_new)[0])
        if kept is not None and self.policy.two_stage:
            hidden, feats = stage1(self.family, self.model, kept, w, self.state, self.taps, routing)
        else:
            hidden, feats = verify_forward(self.family, self.model, tokens[:, :w], self.state, self.taps, routing)
        return Verified(w0, w, hidden, feats, block.tokens[:, : w - 1], routing)

