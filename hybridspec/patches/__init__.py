"""Per-family patches behind a small registry: `family_of(model)` returns the family module.

A family module exposes `MODEL_TYPES`, `text_model(model)`, `text_config(model)`,
`rope(model, hidden, positions)`, `apply_rope(q, k, cos, sin)` and
`gdn_verify_layer(module, x, slot, num_tokens)`, `GDN_PROJECTIONS` (the GDN mixer's input
projections, which `hybridspec.patches.fusion` fuses), `ROUTERS` (the MoE router's module types),
`router_normalizes(router)`, and `GATED_NORM` / `QK_NORM` (the GDN mixer's gated norm and the
attention mixer's q/k norm: class and forward, for `plain_gated_norm` / `plain_norm`).
"""

from __future__ import annotations

from types import ModuleType

from hybridspec.patches import qwen3_5_moe, qwen3_next

FAMILIES: tuple[ModuleType, ...] = (qwen3_5_moe, qwen3_next)


def supported_types() -> list[str]:
    return [name for family in FAMILIES for name in family.MODEL_TYPES]


def family_of(model) -> ModuleType:
    name = type(model).__name__
    for family in FAMILIES:
        if name in family.MODEL_TYPES:
            return family
    raise TypeError(f"hybridspec supports {', '.join(supported_types())}; got {name}")
