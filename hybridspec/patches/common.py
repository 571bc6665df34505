"""The verification forward shared by the hybrid families: transformers' own modules for
embedding, norms, MoE and LM head; our GDN ops, conv-window and KV-buffer handling in between.
Linears a tensor-parallel plan shards go through `hybridspec.parallel` (local shard, the style's
collective); unsharded ones are called as they are."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from hybridspec import parallel
from hybridspec.experts import hybridspec_experts_forward
from hybridspec.fused import fused_rows, fused_weight, plain_unsharded, project
from hybridspec.ops import attention_prologue, decode_attention, gdn_verify_gated, gdn_verify_packed, route_topk, route_topk_partials, small_linear, small_linear_partials
from hybridspec.ops import linear as linear_ops
from hybridspec.ops import moe as moe_ops
from hybridspec.ops.gdn import VERIFY_CONFIG
from hybridspec.ops.linear import fits
from hybridspec.ops.prologue import PROLOGUE_CONFIG
from hybridspec.ops.route import MAX_EXPERTS
from hybridspec.split_projection import split_in_gemm, split_out_projection
from hybridspec.state import GDNSlot


def conv_verify(mod, mixed: torch.Tensor, slot: GDNSlot) -> torch.Tensor:
    """Causal depthwise conv of the round's pre-conv inputs `[B, C, w]` after the layer's window
    `[B, C, K]` (K the kernel size), then the activation, as transformers' single-step update
    computes them; the inputs are kept for the commit."""
    w = mixed.shape[-1]
    slot.inputs[:, :, :w] = mixed
    weight = mod.conv1d.weight[:, 0].float()  # [C, K]
    K = weight.shape[-1]
    full = torch.cat([slot.window, mixed], dim=-1).float()  # [B, C, K + w]
    # output t reads full[t + 1 .. t + K]: the conv as K shifted products summed in fp32 and rounded
    # once to the weight's dtype, as a 16-bit conv1d rounds its fp32 accumulator. Elementwise work
    # that inductor fuses with the activation and the split after it, where F.conv1d (and its
    # im2col on some backends) is a launch of its own.
    out = full[..., 1 : 1 + w] * weight[:, 0, None]
    for j in range(1, K):
        out = out + full[..., 1 + j : 1 + j + w] * weight[:, j, None]
    if mod.conv1d.bias is not None:
        out = out + mod.conv1d.bias.float()[:, None]
    return ACT2FN[mod.activation](out.to(mod.conv1d.weight.dtype)).to(mixed.dtype)


def plain_norm(norm: nn.Module, cls: type, forward) -> bool:
    """`norm` is transformers' `cls` itself with the `forward` it was defined with (kernelize, the
    hub's kernel layers, swaps it for fla's, which rounds otherwise), no instance-level forward and
    no forward hooks: it computes what the class's source says, so one of our kernels may apply it
    instead (for the q/k norms, `naive_prologue.rms_norm(offset=1)`: `attention_prologue`)."""
    return (type(norm) is cls and cls.forward is forward and "forward" not in vars(norm)
            and not norm._forward_hooks and not norm._forward_pre_hooks)


def plain_gated_norm(norm: nn.Module, cls: type, forward) -> bool:
    """`plain_norm` with a silu gate: what it computes is `naive.gated_rms_norm`, so the verify
    kernel may apply it instead (`gdn_verify_gated`)."""
    return plain_norm(norm, cls, forward) and norm.activation == "silu"


def gdn_core(mod, mixed, g, beta, z, slot: GDNSlot, num_tokens: torch.Tensor | None,
             gated_norm: tuple | None = None) -> torch.Tensor:
    """GDN verify of one layer (`mixed` `[B, w, C]`: the conv's q, k and v side by side) into the
    round's factor buffers, then the gated norm and out_proj. `gated_norm`: the family's
    `RMSNormGated` class and its forward (`plain_gated_norm`); where `mod.norm` is that module as
    transformers defines it, one row (the AR step) applies it inside the verify kernel
    (`VERIFY_CONFIG["gated_one_row"]`); any other norm module runs as it is."""
    B, w = mixed.shape[:2]
    kw = dict(num_k_heads=mod.num_k_heads, head_k_dim=mod.head_k_dim, head_v_dim=mod.head_v_dim,
              num_tokens=num_tokens, factors_out=slot.factors)
    if w == 1 and VERIFY_CONFIG["gated_one_row"] and gated_norm and plain_gated_norm(mod.norm, *gated_norm):
        o, _ = gdn_verify_gated(mixed, g, beta, slot.state, z.reshape(B, 1, -1, mod.head_v_dim), mod.norm.weight,
                                mod.norm.variance_epsilon, **kw)
        o = o.reshape(B, w, -1)
    else:
        o, _ = gdn_verify_packed(mixed, g, beta, slot.state, **kw)
        o = mod.norm(o.reshape(-1, mod.head_v_dim), z.reshape(-1, mod.head_v_dim)).reshape(B, w, -1)
    out = split_out_projection(mod.out_proj, o)
    return out if out is not None else parallel.column(mod.out_proj, o, gather=True)


def fused_prologue(mod, qk_norm: tuple | None, cos: torch.Tensor) -> bool:
    """Whether the attention layer's q/k norms, rotary and KV write run as one `attention_prologue`
    launch: on (`PROLOGUE_CONFIG["fused"]`), both norms the family's own (`plain_norm`) with one
    eps and one weight dtype, and a rotary dim the op takes."""
    return bool(PROLOGUE_CONFIG["fused"] and qk_norm and plain_norm(mod.q_norm, *qk_norm)
                and plain_norm(mod.k_norm, *qk_norm) and mod.q_norm.eps == mod.k_norm.eps
                and mod.q_norm.weight.dtype == mod.k_norm.weight.dtype
                and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= mod.head_dim)


def attention_verify(mod, x: torch.Tensor, cos_sin, keys: torch.Tensor, values: torch.Tensor, start, pad,
                     apply_rope, qk_norm: tuple | None = None) -> torch.Tensor:
    """Gated attention of w new tokens against one layer's KV buffers `[B, Hkv, rows, D]`: write each
    row's w new keys/values at its committed length `start` `[B]` (a device tensor), then attend with
    `hybridspec.ops.decode_attention`, which reads only the positions below `start_b + w` and masks
    those before `pad_b` (each row's left padding) (the Triton kernels on CUDA, the fp32 naive twin
    on CPU) and applies the output gate. Under tensor parallelism the heads, and so the KV buffers,
    are this rank's; o_proj sums the ranks' partial products."""
    B, w, _ = x.shape
    hidden_shape = (B, w, -1, mod.head_dim)
    linears = (mod.q_proj, mod.k_proj, mod.v_proj)
    # one GEMM over the fused weight (hybridspec.fused); sharded, each rank's heads
    qg, k, v = project(mod, "qkv", linears, x, gemm=split_in_gemm) or [parallel.column(lin, x, gather=False) for lin in linears]
    q, gate = torch.chunk(qg.reshape(B, w, -1, mod.head_dim * 2), 2, dim=-1)
    if fused_prologue(mod, qk_norm, cos_sin[0]):
        # one launch for the norms, the rotary and the KV write (docs/design.md, "Ops")
        q = attention_prologue(q, k.reshape(hidden_shape), v.reshape(hidden_shape), mod.q_norm.weight,
                               mod.k_norm.weight, *cos_sin, keys, values, start, eps=mod.q_norm.eps)
        return _attend(mod, q, keys, values, start, pad, gate)
    q = mod.q_norm(q.reshape(hidden_shape)).transpose(1, 2)
    k = mod.k_norm(k.reshape(hidden_shape)).transpose(1, 2)
    v = v.reshape(hidden_shape).transpose(1, 2)
    q, k = apply_rope(q, k, *cos_sin)
    # positions live on the device, so write by index; rows past the round's w are computed and
    # never used (row i of batch row b only sees cache indices pad_b .. start_b + i). An index_put,
    # not a scatter_: inductor writes it into the buffer in place, where a compiled scatter_ into
    # an input copied the whole KV buffer out and back (twice per layer, growing with capacity)
    rows = start[:, None] + torch.arange(w, device=x.device)  # [B, w]
    batch = torch.arange(B, device=x.device)[:, None]  # [B, 1]
    keys[batch, :, rows] = k.transpose(1, 2)  # [B, w, Hkv, D]
    values[batch, :, rows] = v.transpose(1, 2)
    return _attend(mod, q.transpose(1, 2), keys, values, start, pad, gate)


def _attend(mod, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start, pad, gate) -> torch.Tensor:
    """`decode_attention` of the rotated `q` `[B, w, Hq, D]` against the written buffers, then o_proj."""
    B, w = q.shape[:2]
    out = decode_attention(q, keys, values, start, scale=mod.scaling, gate=gate, starts=pad)  # [B, w, Hq, D]
    out = out.reshape(B, w, -1)
    projected = split_out_projection(mod.o_proj, out)
    return projected if projected is not None else parallel.row(mod.o_proj, out)


def is_sparse_moe(mlp) -> bool:
    return hasattr(mlp, "gate") and hasattr(mlp, "experts") and hasattr(mlp, "shared_expert")


def route(family, mlp, x: torch.Tensor, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's router on `[B, w, H]` -> expert ids and routing weights `[B, w, k]`: its GEMM
    (or `logits` `[B * w, E]`, where the caller ran it in the block's fused GEMM), then the
    router's softmax, top-k and renormalisation (`route_logits`); without `logits`, the split
    router (`split_route`) where it applies."""
    B, w, H = x.shape
    flat = x.reshape(-1, H)
    split = None if logits is not None else split_route(family, mlp, x, take=1)
    if logits is not None:
        weights, ids = route_logits(family, mlp.gate, logits)
    elif split is not None:
        ids, weights, _ = split
    elif isinstance(mlp.gate.weight, parallel.DTensor) or type(mlp.gate) not in family.ROUTERS:
        # a router under a tensor-parallel plan, or one the family does not know (replaced by the
        # user): its own forward (not the module call: transformers
        # hooks the router to collect router logits, and the hook reads a ContextVar, which dynamo
        # cannot trace; verification never returns router logits)
        _, weights, ids = mlp.gate.forward(flat)
    else:
        weights, ids = route_logits(family, mlp.gate, moe_gemm(flat, mlp.gate.weight))
    return ids.view(B, w, -1), weights.view(B, w, -1)


def split_route(family, mlp, x: torch.Tensor, take: int | None) -> tuple | None:
    """The block's router on `[B, w, H]` with its GEMM as `LinearKernelConfig.router_split_k` split-K
    partial sums over its fused rows (`fused_rows(..., take=take)`: the router's, then the rows fused
    after it), routed by `route_topk_partials`, which adds them: `(ids, weights, rest)`, ids and
    weights `[B, w, k]`, `rest` the outputs of the linears after the router (`project`'s, from the
    same sums). The router's GEMM then spreads over
    `router_split_k` times as many programs, and the reduction costs no launch. None where that is off
    (`router_split_k` 1), the block is not fused, the router is not one the family knows, or the
    kernels would not take the inputs (no kernel device, an autograd graph, more than 64 rows)."""
    splits = linear_ops.KERNEL_CONFIG.router_split_k
    if splits <= 1 or type(mlp.gate) not in family.ROUTERS:
        return None
    rows = fused_rows(mlp, "moe", moe_linears(mlp), take=take)
    if rows is None:
        return None
    weight, sizes = rows
    B, w, H = x.shape
    flat = x.reshape(-1, H)
    if sizes[0] > MAX_EXPERTS or not fits(flat, weight):
        return None
    partials = small_linear_partials(flat, weight, splits)
    weights, ids, rest = route_topk_partials(partials, sizes[0], mlp.gate.top_k,
                                             normalize=family.router_normalizes(mlp.gate), dtype=x.dtype)
    return ids.view(B, w, -1), weights.view(B, w, -1), list(rest.split(sizes[1:], dim=-1)[:-1])


def route_logits(family, router, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`Qwen3_5MoeTopKRouter` / `Qwen3NextTopKRouter` after their GEMM, on `[T, E]` router logits:
    fp32 softmax, the top k, renormalised where the family's router does, in the logits' dtype.
    Returns (weights, ids) `[T, k]`.

    On CUDA one `route_topk` launch instead of aten's softmax, gatherTopK, bitonic sort, division
    and cast (about 15 us a layer at one row on an H200). It picks the same experts as CUDA's
    `torch.topk`, ties included: gatherTopK keeps the lowest indices among probabilities tied at
    the k-th place, as the kernel does (measured over 393,216 bf16 rows holding 43,037 such ties:
    `benchmarks/route_ties.py`; docs/design.md, "route_topk", says which of aten's top-k kernels
    those rows ran). The weights are the same but where the kernel's `exp` differs in
    the last bit (at most 11 rows in 65,536), and the slot order can differ among exactly equal weights
    only, so the experts' weighted sum adds the same terms in another order. On the CPU
    `torch.topk` breaks such ties its own way, so the CPU keeps transformers' ops."""
    normalize = family.router_normalizes(router)
    # the op has no backward: a forward that autograd records keeps torch's ops
    records = torch.is_grad_enabled() and logits.requires_grad
    if logits.is_cuda and logits.shape[-1] <= MAX_EXPERTS and not records:
        return route_topk(logits, router.top_k, normalize=normalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(probs, router.top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def moe_apply(mlp, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts on `hybridspec.ops.moe_experts` (cost follows the distinct experts the w
    tokens touch) plus the block's own shared expert; `x` `[B, w, H]`, `ids`/`weights` `[B, w, k]`.
    `num_tokens` `[B]`: each row's counted tokens; its rows past them read no routed expert (their
    output is never read: at B = 1 with the shared expert inside the op they come out zero, else
    they hold the shared expert's output alone).

    Where `shared_as_expert` allows, the experts op runs the shared expert too, as one more expert
    every row chose: the block is then the fused GEMM, the router's tail and the op's three launches."""
    return _moe_apply(mlp, x, ids, weights, num_tokens, None, shared_as_expert(mlp))


def _moe_apply(mlp, x, ids, weights, num_tokens, shared_in: list | None, ninth) -> torch.Tensor:
    """`moe_apply` given `shared_as_expert(mlp)` (`ninth`) and, where the caller ran the block's
    fused GEMM, its outputs after the router's (`shared_in`: the shared expert's sigmoid gate, and
    where the experts op does not run the shared expert, its gate and up projections)."""
    B, w, H = x.shape
    flat = x.reshape(-1, H)
    if num_tokens is not None and B > 1:
        # the op counts rows of the flat [B * w] layout against one length: per batch row, mark the
        # assignments past that row's count invalid instead (an id outside [0, E) reads no expert);
        # the B * w rows (<= 64) run as one piece, so each expert of the batch's union is read once
        counted = torch.arange(w, device=x.device)[None, :] < num_tokens[:, None]  # [B, w]
        ids = torch.where(counted[..., None], ids, -1)
        num_tokens = None
    ids, weights = ids.reshape(B * w, -1), weights.reshape(B * w, -1)
    # inside a compiled layer the experts' weighted sum fuses into the residual add that reads it
    here = torch.compiler.is_compiling() and moe_ops.KERNEL_CONFIG.combine_in_consumer
    if ninth is not None:
        (gate,) = shared_in or project(mlp, "moe", moe_linears(mlp), flat, skip=1, take=1, gemm=moe_gemm)
        out = hybridspec_experts_forward(mlp.experts, flat, ids, weights, num_tokens=num_tokens, shared=(*ninth, gate),
                                         combine_here=here)
        return out.reshape(B, w, H)
    routed = hybridspec_experts_forward(mlp.experts, flat, ids, weights, num_tokens=num_tokens, combine_here=here)
    shared = mlp.shared_expert
    # the shared expert's sigmoid gate and its gate and up projections in one GEMM, over their rows
    # of the block's fused weight (after the router's); fused only where it is whole on every rank
    fused = shared_in or project(mlp, "moe", moe_linears(mlp), flat, skip=1, gemm=moe_gemm)
    down = mlp.experts.down_proj
    # under tensor parallelism this rank ran its slice of every expert's width: a partial sum
    group = parallel.group_of(down) if parallel.is_sharded(down) else None
    if fused is None and group is not None and parallel.is_sharded(shared.down_proj.weight):
        # the shared expert's output is a partial sum too: both are reduced together (transformers'
        # plan reduces each on its own)
        partial = torch.sigmoid(mlp.shared_expert_gate(flat)) * parallel.row_partial(shared.down_proj, _swiglu_local(shared, flat))
        return parallel.all_reduce(routed + partial, group).reshape(B, w, H)
    if fused is not None:
        gate, g, u = fused
        out = torch.sigmoid(gate) * _down(shared.down_proj, shared.act_fn(g) * u)
    else:
        out = torch.sigmoid(mlp.shared_expert_gate(flat)) * dense_mlp(shared, flat)
    if group is not None:
        routed = parallel.all_reduce(routed, group)
    return (routed + out).reshape(B, w, H)


# the shared expert's activation where the experts op may run it (transformers' "silu", "swish")
_SILU = (nn.SiLU, type(ACT2FN["silu"]))


def shared_as_expert(mlp) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared expert's `(gate_up [2I, H], down [H, I])` weights where the experts op can run it
    as one more expert, else None. It can where its gate and up projections are fused (rows of the
    block's fused weight, adjacent in that order: so neither is sharded, hooked or wrapped), its
    down projection is a plain linear that `_down` would multiply itself, its activation is an
    unhooked SiLU, and its width, dtype and device are the routed experts' (an unsharded experts
    module)."""
    stacked = fused_weight(mlp, "moe")
    if stacked is None:
        return None
    shared, experts = mlp.shared_expert, mlp.experts
    down = shared.down_proj
    act = shared.act_fn
    if not (plain_unsharded(down) and type(act) in _SILU and not act._forward_hooks and not act._forward_pre_hooks
            and not parallel.is_sharded(experts.down_proj)):
        return None
    first = mlp.gate.weight.shape[0] + mlp.shared_expert_gate.weight.shape[0]
    gate_up = stacked[first : first + 2 * down.weight.shape[1]]
    if experts.gate_up_proj.shape[1:] != gate_up.shape:
        return None
    if not (experts.gate_up_proj.dtype == gate_up.dtype == down.weight.dtype and down.weight.is_contiguous()
            and experts.gate_up_proj.device == gate_up.device == down.weight.device):
        return None
    return gate_up, down.weight


def moe_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for the MoE block's narrow weights (the router with the shared expert's
    gate, 272 rows with padding at the 35B-A3B shape, or with its projections too where the experts
    op does not run it; the router's rows alone in Stage 0; the shared expert's down projection in
    that case), on `small_linear` on CUDA where it takes the inputs: 1.16x / 1.14x cuBLAS at one
    row on an H200, timed chained over cold weights in one graph (docs/benchmarks.md, "Few-row
    linear"); inside the runner's profile both take 8.8 us, so the gain there is within noise.
    The mixers' wider projections keep cuBLAS: with them and the output projections on
    `small_linear` too the AR step took 3.33 against 3.20 ms (docs/benchmarks.md, "The fused
    head on by default"). Where autograd records, `fits` says no: the op has no backward."""
    flat = x.reshape(-1, x.shape[-1])
    if x.is_cuda and fits(flat, weight):
        return small_linear(flat, weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def _down(linear, x: torch.Tensor) -> torch.Tensor:
    """The shared expert's down projection: `moe_gemm` for a `plain_unsharded` linear; anything else
    (an adapter in its place, a sharded weight) runs as it is."""
    return moe_gemm(x, linear.weight) if plain_unsharded(linear) else linear(x)


def moe_linears(mlp) -> tuple:
    """The sparse MoE block's linears that read its input, in fusion order: the router first (Stage
    0 runs it alone), the shared expert's sigmoid gate (the block's GEMM runs the two together where
    the experts op runs the shared expert), then the shared expert's gate and up projections: adjacent
    rows, which that op reads as one expert's `[2I, H]` weight."""
    return (mlp.gate, mlp.shared_expert_gate, mlp.shared_expert.gate_proj, mlp.shared_expert.up_proj)


def _swiglu_local(mlp, x: torch.Tensor) -> torch.Tensor:
    """`act(gate_proj(x)) * up_proj(x)`: this rank's slice of the intermediate features."""
    return mlp.act_fn(parallel.column(mlp.gate_proj, x, gather=False)) * parallel.column(mlp.up_proj, x, gather=False)


def dense_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU MLP block (`gate_proj`, `up_proj`, `down_proj`), sharded or not."""
    if not parallel.is_sharded(mlp.down_proj.weight):
        out = mlp(x)
        return out[0] if isinstance(out, tuple) else out
    return parallel.row(mlp.down_proj, _swiglu_local(mlp, x))


def moe_verify(family, mlp, x: torch.Tensor, routing: list | None = None,
               num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE block of a verified block; a sparse block appends its expert ids `[B, w, k]` to
    `routing` when given. Dense MLP layers run as they are. Where the block's linears are fused, the
    router and the shared expert's gate are one GEMM (with the shared expert's projections where the
    experts op does not run it)."""
    if not is_sparse_moe(mlp):
        return dense_mlp(mlp, x)
    # the router and the shared expert's gate; the shared expert's projections too where the
    # experts op does not run it
    ninth = shared_as_expert(mlp)
    take = None if ninth is None else 2
    split = split_route(family, mlp, x, take)
    if split is not None:
        ids, weights, shared_in = split
    else:
        fused = project(mlp, "moe", moe_linears(mlp), x.reshape(-1, x.shape[-1]), gemm=moe_gemm, take=take)
        logits, shared_in = (fused[0], fused[1:]) if fused is not None else (None, None)
        ids, weights = route(family, mlp, x, logits)
    if routing is not None:
        routing.append(ids)
    return _moe_apply(mlp, x, ids, weights, num_tokens, shared_in, ninth)
