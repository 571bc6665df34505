"""`Target`: the verifying model as a round sees it (family, taps, layer blocks, router boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridspec.patches import family_of
from hybridspec.fused import plain_unsharded
from hybridspec.patches.forward import EAGER, Blocks, has_router_boundary
from hybridspec.patches.fusion import fuse_model
from hybridspec.patches.tp import check_sharding


@dataclass
class Target:
    """`taps`: the layers whose outputs the drafter reads, in its order. `blocks`: the per-layer
    functions (eager, or compiled once per layer kind for the runner). `split`: Layer 0 is GDN +
    sparse MoE, so a round can stop at its router (Stage 0) and resume there (Stage 1). Building
    one fuses the model's projections (`hybridspec.patches.fusion`)."""

    model: torch.nn.Module
    taps: tuple[int, ...] = ()
    blocks: Blocks = EAGER
    family: object = field(init=False)
    split: bool = field(init=False)
    num_experts: int = field(init=False)

    def __post_init__(self):
        self.family = family_of(self.model)
        check_sharding(self.family, self.model)
        fuse_model(self.family, self.model)
        self.split = has_router_boundary(self.family, self.model)
        layer0 = self.family.text_model(self.model).layers[0]
        self.num_experts = layer0.mlp.gate.weight.shape[0] if self.split else 0

    def refuse(self) -> None:
        """Re-link the fused projections after weights were replaced (`hybridspec.fused`)."""
        fuse_model(self.family, self.model)

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def plain_head(self) -> bool:
        """The LM head computes `F.linear(h, weight)` on an unsharded weight, so its argmax may come
        from `hybridspec.ops.lm_head_top1` without the logits."""
        return plain_unsharded(self.lm_head)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device
