"""Prefill hand-over and the verification forward of a hybrid GDN + attention + MoE stack."""

from __future__ import annotations

import torch

from hybridspec.ops import GDNFactors
from hybridspec.patches.common import attention_verify, moe_verify
from hybridspec.state import MAX_VERIFY, HybridState


def allocate_state(family, model, cache, max_len: int) -> HybridState:
    """Buffers for one request, filled from transformers' prefill cache (`DynamicCache`)."""
    config = family.text_config(model)
    layers = family.text_model(model).layers
    gdn_layers = [i for i, t in enumerate(config.layer_types) if t == "linear_attention"]
    attn_layers = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    ref = layers[gdn_layers[0]].linear_attn
    conv0 = cache.layers[gdn_layers[0]].conv_states[0]  # [B, C, k]
    B, C, k = conv0.shape
    device = conv0.device
    HK, HV, Kd, Vd = ref.num_k_heads, ref.num_v_heads, ref.head_k_dim, ref.head_v_dim
    Lg = len(gdn_layers)
    states = torch.stack([cache.layers[i].recurrent_states[0].float() for i in gdn_layers]).contiguous()
    factors = GDNFactors(
        torch.zeros(Lg, B, MAX_VERIFY, HV, Vd, device=device),
        torch.zeros(Lg, B, MAX_VERIFY, HK, Kd, device=device),
        torch.zeros(Lg, B, MAX_VERIFY, HV, device=device),
    )
    windows = torch.stack([cache.layers[i].conv_states[0] for i in gdn_layers]).contiguous()
    keys, values = [], []
    length = cache.layers[attn_layers[0]].keys.shape[2]
    for i in attn_layers:
        ck, cv = cache.layers[i].keys, cache.layers[i].values  # [B, Hkv, P, D]
        kb = ck.new_zeros(B, ck.shape[1], max_len, ck.shape[3])
        vb = cv.new_zeros(B, cv.shape[1], max_len, cv.shape[3])
        kb[:, :, :length] = ck
        vb[:, :, :length] = cv
        keys.append(kb)
        values.append(vb)
    return HybridState(
        gdn_layers=gdn_layers, attn_layers=attn_layers, gdn_states=states, factors=factors,
        conv_windows=windows, conv_inputs=windows.new_zeros(Lg, B, C, MAX_VERIFY),
        keys=keys, values=values, length=length,
    )


def verify_forward(family, model, input_ids: torch.Tensor, state: HybridState, taps: tuple[int, ...] = ()):
    """Run w <= 16 tokens after the committed prefix; nothing is committed.

    Returns the final-norm hidden states `[B, w, H]` and the tap features `[B, w, len(taps) * H]`
    (tap i = output of layer i, i.e. transformers' `hidden_states[i + 1]`), in the order of `taps`.
    """
    B, w = input_ids.shape
    if not 1 <= w <= MAX_VERIFY:
        raise ValueError(f"verification length must be in 1..{MAX_VERIFY}, got input_ids {tuple(input_ids.shape)}")
    text = family.text_model(model)
    h = text.embed_tokens(input_ids)
    positions = state.length + torch.arange(w, device=h.device)[None].expand(B, w)
    cos_sin = family.rope(model, h, positions)
    tapped = {}
    for i, layer in enumerate(text.layers):
        x = layer.input_layernorm(h)
        if i in state.gdn_slot:
            x = family.gdn_verify_layer(layer.linear_attn, x, state, state.gdn_slot[i])
        else:
            x = attention_verify(layer.self_attn, x, cos_sin, state, state.attn_slot[i], family.apply_rope)
        h = h + x
        h = h + moe_verify(layer.mlp, layer.post_attention_layernorm(h))
        if i in taps:
            tapped[i] = h
    state.written = w
    features = torch.cat([tapped[i] for i in taps], dim=-1) if taps else h[..., :0]
    return text.norm(h), features
