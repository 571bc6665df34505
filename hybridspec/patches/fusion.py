"""Which linears of a hybrid stack the verification forward fuses (`hybridspec.fused`), per layer."""

from __future__ import annotations

from hybridspec.fused import fuse, unfuse_group
from hybridspec.patches.common import is_sparse_moe, moe_linears


def groups(family, model):
    """`(parent, name, linears)` for every group: each GDN mixer's input projections, each
    attention's q/k/v, each sparse MoE block's router and shared-expert projections and gate."""
    kinds = family.text_config(model).layer_types
    for kind, layer in zip(kinds, family.text_model(model).layers):
        if kind == "linear_attention":
            mod = layer.linear_attn
            yield mod, "in", tuple(getattr(mod, name) for name in family.GDN_PROJECTIONS)
        else:
            mod = layer.self_attn
            yield mod, "qkv", (mod.q_proj, mod.k_proj, mod.v_proj)
        if is_sparse_moe(layer.mlp):
            yield layer.mlp, "moe", moe_linears(layer.mlp)


def fuse_model(family, model) -> int:
    """Fuse every group (or re-link one whose weights were replaced since: `hybridspec.fused`);
    cheap when nothing changed, so every `generate` call runs it. Returns how many groups are fused
    (the runner captures again when any buffer it reads moved, the fused weights among them)."""
    return sum(fuse(parent, name, linears, family.ROUTERS) for parent, name, linears in groups(family, model))


def unfuse_model(family, model) -> None:
    """Every linear its own weight again (what `hybridspec.disable` leaves)."""
    for parent, name, linears in groups(family, model):
        unfuse_group(parent, name, linears)
