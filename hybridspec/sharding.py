"""Models sharded as transformers' `tp_plan` shards them, without `from_pretrained`.

`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` is how users load a
checkpoint under `torchrun`, and what the two-process tests do. Two cases need the same layout
without a checkpoint, which this module builds with transformers' own parallel styles (the ones
`from_pretrained` installs: DTensor parameters, the styles' forwards as module forwards):

- `shard(model, mesh)`: a model already in memory, over any mesh. transformers applies no plan at a
  tensor-parallel size of 1, so this is how a one-GPU run exercises the sharded path (collectives,
  graph capture) at world size 1.
- `build_sharded(...)`: a random-weight model too large for one device (the 122B-A10B shape), built
  on the meta device, sharded, then materialised one decoder layer at a time: each layer's full
  weights are drawn on the device with transformers' initialisation and a seed that every rank
  shares, and each rank keeps its shard. Replicated weights are therefore equal on every rank, and
  the shards together are the weights an unsharded build with the same draws would have.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard

from hybridspec.patches import family_of


def _style(plan: dict, name: str, parameter: bool) -> str | None:
    """transformers' lookup: a parameter's own entry, else its module's; a module's own entry."""
    generic = replace_layer_number_by_wildcard(name)
    if generic in plan:
        return plan[generic]
    if parameter and "." in generic:
        return plan.get(generic.rsplit(".", 1)[0])
    return None


def shard(model: nn.Module, mesh) -> nn.Module:
    """Apply `model.tp_plan` over the 1-D `mesh`, as `from_pretrained` does before loading: each
    planned parameter becomes a `DTensor` holding this rank's shard of its current value (the same
    on every rank: seed the build alike), each planned module gets its style's forward. In place."""
    plan = dict(model.tp_plan or {})
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tp_plan to shard it with")
    for name, module in model.named_modules():
        for p_name, _ in list(module.named_parameters(recurse=False)):
            full = f"{name}.{p_name}" if name else p_name
            style = _style(plan, full, parameter=True)
            if style is not None:
                ALL_PARALLEL_STYLES[style].validate_param(module, p_name, mesh, parameter_name=full)
                ALL_PARALLEL_STYLES[style].shard_param(module, p_name, mesh)
        style = _style(plan, name, parameter=False)
        if style is not None:
            ALL_PARALLEL_STYLES[style].install_forward(module, mesh)
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_sharded(model_cls, config, mesh, device, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    """`model_cls(config)` sharded over `mesh` with random weights, each rank materialising only its
    shards on `device` (plus one decoder layer's full weights at a time while drawing them)."""
    with _default_dtype(dtype), torch.device("meta"):
        model = model_cls(config)
    model.eval().requires_grad_(False)
    shard(model, mesh)
    layers = family_of(model).text_model(model).layers
    inside = {id(m) for m in layers.modules()}
    rest = [m for m in model.modules() if id(m) not in inside]
    for unit, modules in enumerate([rest, *[list(layer.modules()) for layer in layers]]):
        _materialise(model, modules, device, seed * 100_003 + unit)
    return model


def _materialise(model, modules, device, seed: int) -> None:
    """Draw the full weights of `modules` on `device` with transformers' initialisation, then keep
    this rank's shard of every sharded one."""
    placed = []
    for m in modules:
        for name, p in list(m.named_parameters(recurse=False)):
            if p.device.type != "meta":
                continue
            m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                               requires_grad=False)
            placed.append((m, name, p))
        for name, b in list(m.named_buffers(recurse=False)):
            if b.device.type == "meta":
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    # the same draws on every rank: replicated weights agree, shards are slices of one tensor
    torch.manual_seed(seed)
    for m in modules:
        model._init_weights(m)
    for m, name, placeholder in placed:
        if isinstance(placeholder, DTensor):
            local = distribute_tensor(m._parameters[name].data, placeholder.device_mesh, placeholder.placements,
                                      src_data_rank=None)
            m._parameters[name] = nn.Parameter(local, requires_grad=False)
