"""Which tensor-parallel layouts the verification forward supports, checked on the model's own
parameters and plan before any round runs (docs/design.md, "Tensor parallelism").

The verification forward (`patches/common.py`, the family modules) computes each sharded Linear as
the style of transformers' default plan for its role does (`hybridspec.parallel`): attention
heads split (colwise q/k/v, rowwise o_proj), GDN projections gathered (so the GDN core and its
state are replicated), experts split along their width (packed_colwise gate_up_proj, rowwise
down_proj), the shared expert and dense MLPs split, the LM head gathered, the embedding split
over the vocabulary or replicated. `check_sharding` refuses every other layout with what to do.
"""

from __future__ import annotations

import re

from transformers.integrations.tensor_parallel import replace_layer_number_by_wildcard

from hybridspec.parallel import DTensor, is_sharded
from hybridspec.patches.common import is_sparse_moe

# role (the parameter's module path below `layers.N.`, or the top-level module) -> the plan styles
# whose arithmetic the verification forward reproduces for it
ROLE_STYLES = {
    **{f"self_attn.{p}": ("colwise",) for p in ("q_proj", "k_proj", "v_proj")},
    "self_attn.o_proj": ("rowwise",),
    **{f"linear_attn.{p}": ("colwise_gather_output",)
       for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")},
    "mlp.experts.gate_up_proj": ("packed_colwise",),
    "mlp.experts.down_proj": ("rowwise",),
    **{f"{m}.{p}": ("colwise",) for m in ("mlp.shared_expert", "mlp") for p in ("gate_proj", "up_proj")},
    "mlp.shared_expert.down_proj": ("rowwise",),
    "mlp.down_proj": ("rowwise",),
    "lm_head": ("colwise_gather_output",),
    "embed_tokens": ("embedding_rowwise", "embedding_colwise"),
}
# rows of the MoE kernel's tiles: each rank's share of an expert's width must be a multiple
EXPERT_WIDTH_MULTIPLE = 16


def _role(generic_param: str) -> str:
    """`self_attn.q_proj` for `model.layers.*.self_attn.q_proj.weight`, `mlp.experts.down_proj` for
    the experts' own parameter, `lm_head` / `embed_tokens` for the top-level modules."""
    unit = re.sub(r"\.(weight|bias)$", "", generic_param)
    return unit.rsplit("layers.*.", 1)[1] if "layers.*." in unit else unit.rsplit(".", 1)[-1]


def _style(plan: dict, generic_param: str) -> str | None:
    """The plan's style for a parameter: its own entry, else its module's (transformers' rule)."""
    return plan.get(generic_param, plan.get(generic_param.rsplit(".", 1)[0]))


def check_sharding(family, model) -> None:
    """Raise `ValueError` unless the model is unsharded or sharded as the verification forward
    supports: one 1-D tensor-parallel mesh, transformers' default styles for every sharded role,
    even shards, whole attention heads per rank, experts split along their width (not by expert)."""
    sharded = [(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if not sharded:
        return
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    plan = dict(model.tp_plan or {})
    mesh = sharded[0][1].device_mesh
    n = mesh.size()
    for name, p in sharded:
        if p.device_mesh.ndim != 1 or p.device_mesh != mesh:
            raise ValueError(
                f"hybridspec runs models sharded by tensor parallelism alone, over one 1-D mesh; {name} lies on a "
                f"mesh of shape {tuple(p.device_mesh.shape)} ({p.device_mesh.mesh_dim_names}). Load the model with "
                "DistributedConfig(tp_plan=\"auto\") only (no fsdp_size, pp_size or ep_size).")
        placement = p.placements[0]
        if isinstance(placement, Replicate):
            continue
        generic = replace_layer_number_by_wildcard(name)
        role = _role(generic)
        if role.startswith("mlp.experts.") and isinstance(placement, Shard) and placement.dim == 0:
            raise ValueError(
                f"{name} is sharded by expert (an expert-parallel plan, ep_size > 1): hybridspec's MoE kernel runs "
                "every expert on every rank, split along its width. Load the model with "
                "DistributedConfig(tp_plan=\"auto\") and no ep_size: transformers' tensor-parallel plan splits the "
                "experts as packed_colwise gate_up_proj and rowwise down_proj.")
        allowed = ROLE_STYLES.get(role)
        style = _style(plan, generic)
        if allowed is None or style not in allowed:
            expected = f"the verification forward supports {' or '.join(allowed)} there" if allowed else \
                "the verification forward computes that module unsharded"
            raise ValueError(
                f"{name} is sharded as {style!r} by the model's tp_plan; {expected} (transformers' default plan). "
                "Load the model with DistributedConfig(tp_plan=\"auto\") and no override of that entry.")
        if isinstance(placement, _StridedShard):
            dim, parts = placement.dim, n * placement.split_factor
        else:
            dim, parts = placement.dim % p.dim(), n
        if p.shape[dim] % parts:
            raise ValueError(
                f"a tensor-parallel size of {n} does not divide {name} evenly (dimension {dim} of size "
                f"{p.shape[dim]}{f', packed {placement.split_factor} ways' if parts != n else ''}): hybridspec "
                "needs equal shards on every rank. Use a TP size that divides it.")
    _check_heads(family.text_config(model), n)
    _check_experts(family, model, n)


def _check_heads(config, n: int) -> None:
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key)
        if heads % n:
            raise ValueError(
                f"tensor parallelism over {n} ranks splits the attention heads by rank, and {key}={heads} is not a "
                f"multiple of {n} (a rank would hold part of a head). Use a TP size that divides {heads}.")


def _check_experts(family, model, n: int) -> None:
    for layer in family.text_model(model).layers:
        if not is_sparse_moe(layer.mlp) or not is_sharded(layer.mlp.experts.down_proj):
            continue
        experts = layer.mlp.experts
        width = experts.down_proj.shape[-1] // n
        if width % EXPERT_WIDTH_MULTIPLE:
            raise ValueError(
                f"with tensor parallelism over {n} ranks each rank holds {width} of the experts' "
                f"{experts.down_proj.shape[-1]} intermediate features, and hybridspec's MoE kernel needs a multiple "
                f"of {EXPERT_WIDTH_MULTIPLE}. Use a TP size that leaves a multiple of {EXPERT_WIDTH_MULTIPLE} per rank.")
        # every sparse layer has the same width
        return
