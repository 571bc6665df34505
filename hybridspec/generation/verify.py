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
from dataclasses import dataclass, field, replace

import torch

from hybridspec.drafter.protocol import DraftBlock
from hybridspec.ops.routing import new_expert_counts
from hybridspec.patches.forward import has_router_boundary, stage0, stage1, verify_forward
from hybridspec.state import HybridState


@dataclass
class Verifier:
    family: object
    model: torch.nn.Module
    state: HybridState
    policy: object
    taps: tuple[int, ...]
    # per round, the expert ids `[B, w, k]` of every sparse MoE layer (calibration reads them)
    record_routing: bool = False
    routing: list = field(default_factory=list)

    def __post_init__(self):
        self.last_w0 = 0
        self.correction = getattr(self.policy, "correction", None)
        if self.correction is not None and not has_router_boundary(self.family, self.model):
            warnings.warn(f"hybridspec: Layer 0 of this target is not GDN + sparse MoE, so policy="
                          f"{self.policy.name!r} runs single-stage without the routing correction")
            self.correction = None
        if self.correction is not None:
            layer0 = self.family.text_model(self.model).layers[0]
            self.num_experts = layer0.mlp.gate.weight.shape[0]
            self.correction = _on_device(self.correction, self.state.gdn_states.device)

    def __call__(self, anchor: torch.Tensor, block: DraftBlock, remaining: int):
        """Returns `(w, hidden [B, w, H], features [B, w, taps * H], draft [B, w - 1])`."""
        choice = self.policy.select(block, remaining)
        w0 = int(choice.w0[0])
        self.last_w0 = w0
        tokens = torch.cat([anchor, block.tokens], dim=-1)
        self.routing = [] if self.record_routing else None
        u = min(w0 + 1, remaining, tokens.shape[1])
        if self.correction is None or u == w0:
            w = w0
            hidden, feats = verify_forward(self.family, self.model, tokens[:, :w], self.state, self.taps,
                                           self.routing)
            return w, hidden, feats, block.tokens[:, : w - 1]
        kept = stage0(self.family, self.model, tokens[:, :u], self.state)
        # token u = w0 + 1 against the union of the first w0: the last entry of the new-expert counts
        n_new = new_expert_counts(kept.topk_ids, self.num_experts)[:, u - 1]
        keep = self.correction.keep_extra(choice.prefix, choice.w0, n_new)
        w = w0 + int(keep[0])
        if self.policy.two_stage:
            hidden, feats = stage1(self.family, self.model, kept, w, self.state, self.taps, self.routing)
        else:
            hidden, feats = verify_forward(self.family, self.model, tokens[:, :w], self.state, self.taps,
                                           self.routing)
        return w, hidden, feats, block.tokens[:, : w - 1]


def _on_device(correction, device):
    return replace(correction, cost=correction.cost.to(device), nbar=correction.nbar.to(device),
                   nbar_given=correction.nbar_given.to(device))
