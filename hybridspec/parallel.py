"""Tensor parallelism as transformers' `tp_plan` leaves a model (docs/design.md, "Tensor parallelism").

transformers shards a parameter by turning it into a `DTensor` whose local shard this rank holds,
and installs each plan style as the module's `forward` (DTensor redistribution, or a c10d
collective, around a local matmul). Its own forward, our prefill, runs through those. The
verification forward does not: for a sharded weight it multiplies by the local shard itself and
issues the collective the style would, as a plain `torch.distributed` call (gloo on CPU, NCCL on
GPU), which a CUDA graph captures and dynamo traces, and which costs no DTensor dispatch on the
host. For a weight that is not a `DTensor` every function here calls the module as it is, so an
unsharded model runs exactly as before.

Shards are even (`patches.tp.check_sharding` refuses others), so rank r of a group of n holds rows
`r * s .. (r + 1) * s - 1` of a dimension of size `n * s`.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

if torch.distributed.is_available():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    # torch 2.13 renamed all_gather_into_tensor (and warns on the old name); 2.11 has only the old one
    _all_gather = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
else:
    dist = None

    class DTensor:  # noqa: D101 - stands in for the type check on builds without torch.distributed
        pass


def is_sharded(t) -> bool:
    """A parameter transformers' plan split over its mesh (a `DTensor` not replicated on every rank)."""
    return isinstance(t, DTensor) and not all(p.is_replicate() for p in t.placements)


def local(t):
    """This rank's shard of `t` (`t` itself when it is not a `DTensor`); None stays None."""
    return t.to_local() if isinstance(t, DTensor) else t


def group_of(t):
    """The process group of the mesh `t` is sharded over (1-D meshes: `check_sharding` refuses others)."""
    return t.device_mesh.get_group()


def model_group(model):
    """The tensor-parallel process group of a model transformers' plan sharded, else None."""
    for p in model.parameters():
        if is_sharded(p):
            return group_of(p)
    return None


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over `group` in place (the rowwise styles' reduction); returns `x`."""
    dist.all_reduce(x, group=group)
    return x


def gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension, in rank order (a colwise output gathered)."""
    n = group.size()
    # the ranks' tensors stacked along a new leading dimension (written as their concatenation
    # along dim 0, the form every backend takes)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    _all_gather(out, x.contiguous(), group=group)
    # [n, ..., s] -> [..., n, s] -> [..., n * s]
    return out.view(n, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])


def column(linear, x: torch.Tensor, gather: bool) -> torch.Tensor:
    """`linear(x)` for a Linear whose output features may be sharded ("colwise"): this rank's
    output features, or, with `gather` ("colwise_gather_output"), all of them."""
    w = linear.weight
    if not isinstance(w, DTensor):
        return linear(x)
    y = F.linear(x, w.to_local(), local(linear.bias))
    return gather_last(y, group_of(w)) if gather and is_sharded(w) else y


def columns_gathered(linears, x: torch.Tensor) -> list[torch.Tensor]:
    """`[m(x) for m in linears]` for Linears with gathered sharded outputs over one group: one
    all-gather for all of them instead of one each (the GDN input projections)."""
    if not all(is_sharded(m.weight) for m in linears):
        return [column(m, x, gather=True) for m in linears]
    parts = [F.linear(x, m.weight.to_local(), local(m.bias)) for m in linears]
    sizes = [p.shape[-1] for p in parts]
    group = group_of(linears[0].weight)
    n = group.size()
    # [..., n, sum(sizes)]: rank r's local outputs of every module side by side
    full = gather_last(torch.cat(parts, dim=-1), group).unflatten(-1, (n, sum(sizes)))
    return [p.flatten(-2) for p in torch.split(full, sizes, dim=-1)]


def row_partial(linear, x: torch.Tensor) -> torch.Tensor:
    """This rank's partial product of a Linear whose input features are sharded ("rowwise"), without
    the bias: the sum over the group of these is `linear(x)` less its bias."""
    return F.linear(x, local(linear.weight))


def row(linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` for a Linear whose input features may be sharded ("rowwise"): `x` holds this
    rank's slice of them; the partial products are summed over the group, then the bias added once."""
    w = linear.weight
    if not isinstance(w, DTensor):
        return linear(x)
    y = row_partial(linear, x)
    if is_sharded(w):
        all_reduce(y, group_of(w))
    return y if linear.bias is None else y + local(linear.bias)


def embedding(emb, ids: torch.Tensor, raw: bool = False) -> torch.Tensor:
    """`emb(ids)` for an Embedding whose vocabulary may be sharded ("embedding_rowwise": each rank
    looks up the ids it holds, zeros for the others, and the ranks' lookups are summed). `raw`: the
    table's rows, never the module's forward (which a model may scale)."""
    w = emb.weight
    if not isinstance(w, DTensor):
        return F.embedding(ids, w) if raw else emb(ids)
    table = w.to_local()
    if table.shape[0] == w.shape[0]:
        # replicated, or sharded along the hidden dimension ("embedding_colwise")
        out = F.embedding(ids, table)
        return out if table.shape[1] == w.shape[1] else gather_last(out, group_of(w))
    group = group_of(w)
    rows = table.shape[0]
    shifted = ids - group.rank() * rows
    outside = (shifted < 0) | (shifted >= rows)
    out = F.embedding(shifted.masked_fill(outside, 0), table).masked_fill(outside[..., None], 0)
    return all_reduce(out, group)


def generator_digests(group, device: torch.device) -> list[str]:
    """Every rank's digest of the global generator that sampling draws from on `device` (the CUDA
    generator of that device, or the CPU one), gathered over `group`: one collective per call."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    mine = hashlib.sha256(state.numpy().tobytes()).hexdigest()[:16]
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return every
