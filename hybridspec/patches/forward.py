"""Prefill hand-over and the verification forward of a hybrid GDN + attention + MoE stack."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridspec import parallel
from hybridspec.ops import GDNFactors
from hybridspec.patches.common import attention_verify, is_sparse_moe, moe_apply, moe_verify, route
from hybridspec.state import MAX_VERIFY, GDNSlot, HybridState


def allocate_state(family, model, cache, max_len: int, pad: torch.Tensor | None = None) -> HybridState:
    """Buffers for one request, filled from transformers' prefill cache (`DynamicCache`)."""
    config = family.text_config(model)
    first_gdn = config.layer_types.index("linear_attention")
    conv0 = cache.layers[first_gdn].conv_states[0]  # [B, C, k]
    state = empty_state(family, model, conv0.shape[0], max_len, conv0.device)
    load_prefill(state, cache, pad)
    return state


def empty_state(family, model, batch_size: int, max_len: int, device) -> HybridState:
    """Zeroed buffers for `batch_size` rows and `max_len` positions, committed length 0."""
    config = family.text_config(model)
    layers = family.text_model(model).layers
    gdn_layers = [i for i, t in enumerate(config.layer_types) if t == "linear_attention"]
    attn_layers = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    ref = layers[gdn_layers[0]].linear_attn
    B, Lg = batch_size, len(gdn_layers)
    C, k = ref.conv1d.weight.shape[0], ref.conv1d.weight.shape[-1]
    HK, HV, Kd, Vd = ref.num_k_heads, ref.num_v_heads, ref.head_k_dim, ref.head_v_dim
    fp32 = dict(dtype=torch.float32, device=device)
    factors = GDNFactors(
        torch.zeros(Lg, B, MAX_VERIFY, HV, Vd, **fp32),
        torch.zeros(Lg, B, MAX_VERIFY, HK, Kd, **fp32),
        torch.zeros(Lg, B, MAX_VERIFY, HV, **fp32),
    )
    # activations (and so the cache rows) carry the embedding's dtype
    act = family.text_model(model).embed_tokens.weight.dtype
    windows = torch.zeros(Lg, B, C, k, dtype=act, device=device)
    keys, values = [], []
    for i in attn_layers:
        attn = layers[i].self_attn
        # this rank's KV heads under tensor parallelism (k_proj colwise), all of them otherwise
        shape = (B, parallel.local(attn.k_proj.weight).shape[0] // attn.head_dim, max_len, attn.head_dim)
        keys.append(torch.zeros(shape, dtype=act, device=device))
        values.append(torch.zeros(shape, dtype=act, device=device))
    return HybridState(
        gdn_layers=gdn_layers, attn_layers=attn_layers,
        gdn_states=torch.zeros(Lg, B, HV, Kd, Vd, **fp32), factors=factors,
        conv_windows=windows, conv_inputs=windows.new_zeros(Lg, B, C, MAX_VERIFY),
        keys=keys, values=values, length=torch.zeros(B, dtype=torch.long, device=device),
        pad=torch.zeros(B, dtype=torch.long, device=device),
    )


def load_prefill(state: HybridState, cache, pad: torch.Tensor | None = None) -> None:
    """Copy a prefill `DynamicCache` into `state`'s buffers in place (their addresses stay, as
    captured graphs need) and set every row's committed length to the (padded) prompt length;
    `pad` `[B]`: each row's left padding (None: none). The cache's padded rows are copied too and
    stay masked: transformers' prefill zeroed their GDN inputs, so they reached no state or window."""
    for n, i in enumerate(state.gdn_layers):
        state.gdn_states[n].copy_(cache.layers[i].recurrent_states[0])
        state.conv_windows[n].copy_(cache.layers[i].conv_states[0])
    length = cache.layers[state.attn_layers[0]].keys.shape[2]
    for n, i in enumerate(state.attn_layers):
        if length > state.keys[n].shape[2]:
            raise ValueError(f"a prompt of {length} tokens does not fit a state of {state.keys[n].shape[2]} positions")
        if cache.layers[i].keys.shape[1] != state.keys[n].shape[1]:
            # a slice assignment would broadcast one head over several
            raise ValueError(f"layer {i}'s prefill cache holds {cache.layers[i].keys.shape[1]} KV heads and the state "
                             f"{state.keys[n].shape[1]}: the model's tensor-parallel layout changed after the state "
                             "was allocated")
        state.keys[n][:, :, :length] = cache.layers[i].keys
        state.values[n][:, :, :length] = cache.layers[i].values
    state.length.fill_(length)
    if pad is None:
        state.pad.zero_()
    else:
        state.pad.copy_(pad)
    state.written = 0


class Stage0(NamedTuple):
    """What Stage 0 keeps at the router boundary of Layer 0, for the u tokens it ran: the residual
    stream after Layer 0's GDN mixer, the MoE block's input (post-attention norm), and the routing."""

    residual: torch.Tensor  # [B, u, H]
    moe_input: torch.Tensor  # [B, u, H]
    topk_ids: torch.Tensor  # [B, u, k]
    topk_weights: torch.Tensor  # [B, u, k]


def has_router_boundary(family, model) -> bool:
    """Two-stage verification needs Layer 0 to be GDN followed by a sparse MoE block."""
    layer = family.text_model(model).layers[0]
    return family.text_config(model).layer_types[0] == "linear_attention" and is_sparse_moe(layer.mlp)


def verify_forward(family, model, input_ids: torch.Tensor, state: HybridState, taps: tuple[int, ...] = (),
                   routing: list | None = None, blocks: Blocks | None = None):
    """Run w <= 16 tokens after the committed prefix; nothing is committed.

    Returns the final-norm hidden states `[B, w, H]` and the tap features `[B, w, len(taps) * H]`
    (tap i = output of layer i, i.e. transformers' `hidden_states[i + 1]`), in the order of `taps`.
    With `routing` given, every sparse MoE layer appends its expert ids `[B, w, k]` in layer order.
    """
    _check_length(input_ids)
    h = parallel.embedding(family.text_model(model).embed_tokens, input_ids)
    return _layers(family, model, h, 0, state, taps, routing, blocks=blocks or EAGER)


def stage0(family, model, input_ids: torch.Tensor, state: HybridState, blocks: Blocks | None = None) -> Stage0:
    """Embedding, Layer-0 GDN and the Layer-0 router for u tokens, stopping before any routed
    expert. Layer 0's factors and conv inputs for the u tokens are written; since the first m of
    them depend only on the first m tokens, Stage 1 may keep any w <= u of them. `blocks`: Layer 0
    as `Blocks.layer0` (compiled where the runner compiles the layers), eager by default."""
    _check_length(input_ids)
    text = family.text_model(model)
    h = parallel.embedding(text.embed_tokens, input_ids)
    slot = state.gdn(0, input_ids.shape[1])
    return Stage0(*(blocks or EAGER).layer0(family, text.layers[0], h, slot, state.num_tokens))


def stage1(family, model, kept: Stage0, w: int, state: HybridState, taps: tuple[int, ...] = (),
           routing: list | None = None, blocks: Blocks | None = None):
    """Resume at Layer 0's experts for the first w Stage-0 tokens and run the rest of the stack;
    returns what `verify_forward` returns for those w tokens. Stage-0 rows past w are not read."""
    layer = family.text_model(model).layers[0]
    state.relayout(0, kept.residual.shape[1], w)
    ids = kept.topk_ids[:, :w]
    if routing is not None:
        routing.append(ids)
    h = kept.residual[:, :w] + moe_apply(layer.mlp, kept.moe_input[:, :w], ids, kept.topk_weights[:, :w],
                                         state.num_tokens)
    return _layers(family, model, h, 1, state, taps, routing, tapped={0: h} if 0 in taps else {},
                   blocks=blocks or EAGER)


def _check_length(input_ids: torch.Tensor) -> None:
    if not 1 <= input_ids.shape[1] <= MAX_VERIFY:
        raise ValueError(f"verification length must be in 1..{MAX_VERIFY}, got input_ids {tuple(input_ids.shape)}")


# A block takes its layer's normed input `x` (`layer.input_layernorm(h)`) from the block before it
# and returns the residual stream with `next_norm` of it (the next layer's input norm, or the
# stack's final norm after the last layer). Compiled, the norm then rides in the kernel that adds
# the MoE block's output to the residual instead of opening the next layer's graph with a launch
# of its own: one launch fewer per layer (docs/design.md, "Layer boundaries").


def gdn_block(family, layer, h: torch.Tensor, x: torch.Tensor, next_norm, slot: GDNSlot, num_tokens,
              routing=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One GDN decoder layer of a verified block: mixer and MoE with their residuals."""
    h = h + family.gdn_verify_layer(layer.linear_attn, x, slot, num_tokens)
    h = h + moe_verify(family, layer.mlp, layer.post_attention_layernorm(h), routing, num_tokens)
    return h, next_norm(h)


def attention_block(family, layer, h: torch.Tensor, x: torch.Tensor, next_norm, cos_sin, keys, values, length,
                    pad, num_tokens, routing=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention decoder layer of a verified block (`gdn_block` says what `x` and `next_norm` are)."""
    h = h + attention_verify(layer.self_attn, x, cos_sin, keys, values, length, pad, family.apply_rope,
                             qk_norm=family.QK_NORM)
    h = h + moe_verify(family, layer.mlp, layer.post_attention_layernorm(h), routing, num_tokens)
    return h, next_norm(h)


def layer0_block(family, layer, h: torch.Tensor, slot: GDNSlot, num_tokens):
    """Stage 0's part of Layer 0 on the embedded rows: the GDN mixer with its residual, the MoE
    block's input norm and its router, stopping before any routed expert. Returns (residual, MoE
    input, expert ids, expert weights), `Stage0`'s fields."""
    h = h + family.gdn_verify_layer(layer.linear_attn, layer.input_layernorm(h), slot, num_tokens)
    y = layer.post_attention_layernorm(h)
    ids, weights = route(family, layer.mlp, y)
    return h, y, ids, weights


def rope_block(family, model, h: torch.Tensor, length: torch.Tensor, pad: torch.Tensor):
    """cos/sin (`family.rope`) of the verified rows `h` `[B, w, H]` after each row's `length`
    committed cache rows, `pad` of them left padding: eagerly about fifteen small kernels a step."""
    # transformers' position of cache index j in a left-padded row is j - pad
    positions = (length - pad)[:, None] + torch.arange(h.shape[1], device=h.device)  # [B, w]
    return family.rope(model, h, positions)


def norm_block(norm, h: torch.Tensor) -> torch.Tensor:
    """The first verified layer's input norm (eagerly about seven small kernels a step); every
    later norm rides in the block before it."""
    return norm(h)


class Blocks(NamedTuple):
    """The per-layer functions `_layers` and `stage0` call: eager (`EAGER`), or compiled once per
    layer kind (`compiled_once(Blocks, layer_options())`: every layer of a kind shares one compiled
    graph, regional compilation, parameters are graph inputs). `rope` is the stack's RoPE and
    `norm` the first verified layer's input norm (each block adds the next norm, `gdn_block`). `layer0` is Stage 0's Layer 0: eagerly
    about 50 small kernels a round (the norms, the conv and gates around the verify kernel, the
    router's cast); on the H200 this form, the embedding eager, takes 0.068 ms a round against 0.19
    eagerly (docs/benchmarks.md, "The compiled blocks measured")."""

    gdn: object = gdn_block
    attention: object = attention_block
    layer0: object = layer0_block
    rope: object = rope_block
    norm: object = norm_block

EAGER = Blocks()


def _layers(family, model, h, start: int, state: HybridState, taps, routing, tapped: dict | None = None,
            blocks: Blocks = EAGER):
    """Layers `start..` on the residual stream `h` `[B, w, H]`; `tapped` holds the taps of layers
    before `start` (Stage 1 has run Layer 0 itself)."""
    B, w = h.shape[:2]
    text = family.text_model(model)
    cos_sin = blocks.rope(family, model, h, state.length, state.pad)
    tapped = dict(tapped or {})
    layers = text.layers
    x = blocks.norm(layers[start].input_layernorm, h)
    for i in range(start, len(layers)):
        layer = layers[i]
        next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else text.norm
        if i in state.gdn_slot:
            h, x = blocks.gdn(family, layer, h, x, next_norm, state.gdn(i, w), state.num_tokens, routing)
        else:
            ai = state.attn_slot[i]
            h, x = blocks.attention(family, layer, h, x, next_norm, cos_sin, state.keys[ai], state.values[ai],
                                    state.length, state.pad, state.num_tokens, routing)
        if i in taps:
            tapped[i] = h
    state.written = w
    out = x  # the final norm of the last layer's output
    # transformers' last `hidden_states` entry, which the prefill taps, is the final-normed output:
    # a drafter tapping the last layer reads the same there and in every round
    last = len(text.layers) - 1
    if last in taps:
        tapped[last] = out
    features = torch.cat([tapped[i] for i in taps], dim=-1) if taps else h[..., :0]
    return out, features
