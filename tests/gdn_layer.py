"""One GDN layer of the tiny targets verified by `family.gdn_verify_layer`, fused (`gdn_conv_verify`)
or unfused (conv, gates, `gdn_verify`), against transformers' own module continuing from its cache."""

from __future__ import annotations

from unittest import mock

import torch
from transformers import DynamicCache

from hybridspec.ops import GDNFactors, gdn_commit
from hybridspec.ops.dispatch import launch_counts, use_triton
from hybridspec.patches import common, family_of
from hybridspec.state import MAX_VERIFY, GDNSlot
from tests.helpers import assert_rel
from tests.models import qwen3_next_causal_lm, qwen35_causal_lm

BUILDERS = {"qwen35": qwen35_causal_lm, "qwen3_next": qwen3_next_causal_lm}


def tiny_layer(name: str, device: str, dtype=torch.float32, seed: int = 0):
    """A tiny target of the family `name` and its first GDN mixer."""
    model = BUILDERS[name](seed=seed).to(device=device, dtype=dtype)
    return model, family_of(model).text_model(model).layers[0].linear_attn


def verify_layer(model, x: torch.Tensor, state: torch.Tensor, window: torch.Tensor, n: int | None, fused: bool):
    """Layer 0's mixer on `x` `[B, w, H]` from copies of `state` and `window`, counting `n` rows
    (None: all); `fused=False` hooks the conv (a no-op hook), which keeps the unfused path. Asserts
    the path taken (and, where Triton runs, its one launch). Returns the output and the slot."""
    family = family_of(model)
    mod = family.text_model(model).layers[0].linear_attn
    B, w = x.shape[:2]
    HV, K, V = state.shape[1:]
    f32 = dict(dtype=torch.float32, device=x.device)
    factors = GDNFactors(torch.zeros(B, w, HV, V, **f32), torch.zeros(B, w, mod.num_k_heads, K, **f32),
                         torch.zeros(B, w, HV, **f32))
    slot = GDNSlot(state.clone(), factors, window.clone(), window.new_zeros(B, window.shape[1], MAX_VERIFY))
    num_tokens = None if n is None else torch.full((B,), n, device=x.device)
    hook = None if fused else mod.conv1d.register_forward_hook(lambda *args: None)
    before = dict(launch_counts)
    try:
        with mock.patch.object(common, "gdn_conv_verify", wraps=common.gdn_conv_verify) as conv_op, \
                mock.patch.object(common, "gdn_verify", wraps=common.gdn_verify) as verify_op, torch.no_grad():
            out = family.gdn_verify_layer(mod, x, slot, num_tokens)
    finally:
        if hook is not None:
            hook.remove()
    assert (conv_op.call_count, verify_op.call_count) == (int(fused), int(not fused))
    if use_triton(x):
        launched = {op: launch_counts[op] - before.get(op, 0) for op in ("gdn_conv_verify", "gdn_verify")}
        assert launched == {"gdn_conv_verify": int(fused), "gdn_verify": int(not fused)}, launched
    return out, slot


def layer_inputs(model, mod, w: int, n: int | None, seed: int = 0):
    """A 5-token prefix run through transformers' module into a cache, the layer's state and conv
    window after it, and w new rows `[2, w, H]` (rows past n NaN)."""
    gen = torch.Generator().manual_seed(seed)
    H = family_of(model).text_config(model).hidden_size
    p = next(model.parameters())
    prefix = torch.randn(2, 5, H, generator=gen).to(p)
    new = torch.randn(2, w, H, generator=gen).to(p)
    if n is not None:
        new[:, n:] = float("nan")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        mod(prefix, cache_params=cache)
    layer = cache.layers[0]
    return cache, layer.recurrent_states[0].float().clone(), layer.conv_states[0].clone(), new


def check_against_transformers(name: str, device: str, fused: bool, w: int, n: int | None, seed: int = 0):
    """fp32: our layer on w rows against transformers' module fed the first n of them (n = w where
    None) after the cache's prefix: outputs of the counted rows, then the state and conv window
    after committing n rows (`HybridState.commit`'s window roll over the round's kept inputs)."""
    # on the GPU transformers' module runs fla's kernels where fla imports (TF32 dots): the op tests
    # hold the kernels to 1e-5 against the twins there
    tol = 1e-5 if device == "cpu" else 1e-3
    model, mod = tiny_layer(name, device, seed=seed)
    cache, state, window, new = layer_inputs(model, mod, w, n, seed)
    out, slot = verify_layer(model, new, state, window, n, fused)
    m = w if n is None else n
    if m > 0:
        with torch.no_grad():
            ref = mod(new[:, :m], cache_params=cache)
        assert_rel(out[:, :m], ref, tol, f"{name} layer output vs transformers")
    gdn_commit(slot.state[None], GDNFactors(*(f[None] for f in slot.factors)), torch.full((2,), m, device=device))
    assert_rel(slot.state, cache.layers[0].recurrent_states[0].float(), tol, f"{name} state after {m} rows")
    rolled = torch.cat([slot.window, slot.inputs[..., :w]], dim=-1)[..., m : m + window.shape[-1]]
    assert_rel(rolled, cache.layers[0].conv_states[0], 1e-6, f"{name} conv window after {m} rows")
