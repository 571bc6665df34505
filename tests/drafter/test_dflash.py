"""DFlashDrafter against the upstream reference (PyPI dflash==0.1.0), and its loading, binding and
drafting contract. CPU, fp32, tiny random shapes."""

import json

import pytest
import torch
from transformers import Qwen3Config

from hybridspec import DFlashDrafter
from hybridspec import fused as fused_mod
from hybridspec.drafter import CompilableDrafter, DFlashConfig, Drafter, dflash, layers
from tests.helpers import assert_rel
from tests.models import BASE, TEXT, TAPS, VOCAB, config, qwen35_causal_lm, random_drafter

TOL = 1e-5
HIDDEN = TEXT["hidden_size"]
SLIDING = dict(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=5)
VARIANTS = {
    "default": {},
    "causal": dict(is_causal=True),
    "sliding": SLIDING,
    "sliding_noncausal": dict(SLIDING, is_causal=False),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    "linear_bias_mha": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True,
                            num_key_value_heads=4),
}


def reference():
    try:
        import dflash.model
    except ImportError:
        pytest.fail("the reference implementation is missing: pip install --no-deps dflash==0.1.0")
    return dflash.model


def taps(hidden_states, layer_ids):
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_matches_reference(variant):
    raw = config(**VARIANTS[variant])
    ours = random_drafter(raw)
    ref = reference().DFlashDraftModel(Qwen3Config(**raw)).eval()
    ref.load_state_dict(ours.state_dict())
    B, C, T = 2, 11, 16
    gen = torch.Generator().manual_seed(1)
    target_hidden = torch.randn(B, C, len(TAPS) * HIDDEN, generator=gen)
    noise = torch.randn(B, T, HIDDEN, generator=gen)
    position_ids = (torch.arange(C + T) + 3)[None].expand(B, -1)
    with torch.no_grad():
        out = ours(target_hidden, noise, position_ids)
        expected = ref(position_ids=position_ids, noise_embedding=noise, target_hidden=target_hidden)
    assert_rel(out, expected, TOL, variant)


# the reference calls the target with the pre-5.24 `past_key_values` name
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_first_round_drafts_match_reference(tmp_path):
    ref_model = reference()
    random_drafter(config()).save_pretrained(tmp_path)
    ours = DFlashDrafter.from_pretrained(tmp_path, dtype=torch.float32)
    ref = ref_model.DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    target = qwen35_causal_lm()
    prompt = torch.randint(0, VOCAB - 4, (1, 9), generator=torch.Generator().manual_seed(2))

    class FirstRound(Exception):
        pass

    def first_round(hidden, head):
        raise FirstRound(compute_logits(hidden, head))

    # the reference's own decoding loop, stopped at its first draft
    compute_logits, ref.compute_logits = ref.compute_logits, first_round
    with pytest.raises(FirstRound) as drafted:
        ref_model.dflash_generate(ref, target, prompt, max_new_tokens=20, stop_token_ids=None)
    ref_logits = drafted.value.args[0][0]  # [D, V]

    assert isinstance(ours.bind(target), Drafter)
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
    ours.start(prompt, taps(out.hidden_states, ours.target_layer_ids))
    anchor = out.logits[:, -1].argmax(-1)
    block = ours.propose(torch.cat([prompt, anchor[:, None]], dim=1))

    probs = torch.softmax(ref_logits, -1)
    assert block.tokens.shape == (1, 15)
    assert block.tokens[0].tolist() == ref_logits.argmax(-1).tolist()
    assert len(set(block.tokens[0].tolist())) > 3, "degenerate drafts make this comparison weak"
    assert_rel(block.confidence[0], probs.max(-1).values, TOL, "confidence")
    assert_rel(block.entropy[0], -(probs * probs.log()).sum(-1), TOL, "entropy")


# default: non-causal full layers (decode_attention, causal=False); causal: decode_attention,
# causal=True; sliding: a full layer and a causal sliding-window layer (SDPA under a mask)
@pytest.mark.parametrize("variant", ["default", "causal", "sliding"])
@pytest.mark.parametrize("preallocate", [False, True])
def test_drafting_equals_stateless_forward(variant, preallocate):
    """Rounds of "write w, advance m" (m per row, stale rows left behind, the cache growing) draft
    exactly what one stateless forward over the committed context drafts."""
    drafter = random_drafter(config(**VARIANTS[variant])).bind(qwen35_causal_lm())
    B, P, W, F = 2, 50, drafter.block_size, len(TAPS) * HIDDEN
    gen = torch.Generator().manual_seed(3)
    feats = torch.randn(B, P, F, generator=gen)
    prompt = torch.randint(0, VOCAB, (B, P), generator=gen)
    if preallocate:
        drafter.reset(B, max_length=P + 6 * W)
        drafter.observe(feats, P)
        storage = drafter.context.k.data_ptr()
    else:
        drafter.start(prompt, feats)
    context = [feats[b] for b in range(B)]
    for rnd in range(6):
        anchor = torch.randint(0, VOCAB, (B,), generator=gen)
        block = drafter.propose(anchor)
        for b in range(B):
            L = context[b].shape[0]
            ids = torch.tensor([[anchor[b].item()] + [drafter.mask_token_id] * (W - 1)])
            with torch.no_grad():
                h = drafter(context[b][None], drafter.embed(ids), torch.arange(L + W)[None])
                probs = torch.softmax(drafter.compute_logits(h[:, 1:]), -1)
            assert drafter.context.length[b].item() == L
            assert block.tokens[b].tolist() == probs.argmax(-1)[0].tolist()
            assert_rel(block.confidence[b], probs.max(-1).values[0], TOL, f"round {rnd} row {b}")
        w = int(torch.randint(2, W + 1, (), generator=gen))
        new = torch.randn(B, w, F, generator=gen)
        m = torch.randint(1, w + 1, (B,), generator=gen)
        if preallocate:
            drafter.observe(new, m)
        else:
            # the loop's form: one int for every row
            drafter.observe(new, int(m[0]))
            m = m[:1].expand(B)
        context = [torch.cat([context[b], new[b, : m[b]]]) for b in range(B)]
    if preallocate:
        assert drafter.context.k.data_ptr() == storage, "a preallocated cache must not move"
    else:
        assert drafter.context.rows > P + W, "the test should make the cache grow"


@pytest.mark.parametrize("variant, full, sliding", [("default", 2, 0), ("causal", 2, 0), ("sliding", 1, 1)])
def test_full_layers_draft_through_decode_attention_without_a_mask(monkeypatch, variant, full, sliding):
    """`propose` runs every layer without a sliding window through decode_attention with the cache's
    lengths and starts and the layer's causality, and builds masks for the sliding-window layers only."""
    calls, masks = [], []

    def attention(q, keys, values, lengths, **kw):
        calls.append(kw["causal"])
        assert lengths is drafter.context.length and kw["starts"] is drafter.context.start
        return decode_attention(q, keys, values, lengths, **kw)

    def mask(*args):
        masks.append(args[3])
        return visibility(*args)

    decode_attention, visibility = layers.decode_attention, dflash.visibility
    monkeypatch.setattr(layers, "decode_attention", attention)
    monkeypatch.setattr(dflash, "visibility", mask)
    drafter = random_drafter(config(**VARIANTS[variant])).bind(qwen35_causal_lm())
    drafter.reset(2, max_length=40, pad=torch.tensor([0, 2]))
    drafter.observe(torch.randn(2, 9, len(TAPS) * HIDDEN), 9)
    drafter.propose(torch.tensor([3, 4]))
    assert calls == [variant == "causal"] * full
    assert masks == [SLIDING["sliding_window"]] * sliding


def _draft_rounds(drafter, seed: int, rounds: int, after_reset=None) -> list:
    """A batch of two (the second row left-padded by 3) with a 20-position context, then `rounds`
    rounds of propose + observe with random features and per-row commits; the draft blocks."""
    B, F = 2, len(TAPS) * HIDDEN
    gen = torch.Generator().manual_seed(seed)
    drafter.reset(B, max_length=80, pad=torch.tensor([0, 3]))
    if after_reset is not None:
        after_reset()
    drafter.observe(torch.randn(B, 20, F, generator=gen), 20)
    blocks = []
    for _ in range(rounds):
        blocks.append(drafter.propose(torch.randint(0, VOCAB, (B,), generator=gen)))
        drafter.observe(torch.randn(B, 16, F, generator=gen), torch.randint(1, 17, (B,), generator=gen))
    return blocks


def test_compiled_layers_draft_what_the_eager_ones_do():
    """`compile_layers(True)` (what the runner turns on where it compiles the target): rounds of
    both layer kinds, left padding and per-row lengths draft the same tokens as eager layers, and
    `observe` of each round's 16 rows, on the compiled context blocks, fills the context cache as
    the eager one does (the prompt's 20 rows stay eager)."""
    drafter = random_drafter(config(**SLIDING)).bind(qwen35_causal_lm())
    assert isinstance(drafter, CompilableDrafter)
    observed = []

    def rounds(compiled):
        drafter.compile_layers(compiled)
        if compiled:
            blocks = drafter._blocks
            assert blocks.context is not layers.context_block

            def counted(*args):
                observed.append(args[-1].shape[1])
                return blocks.context(*args)

            drafter._blocks = blocks._replace(context=counted)
        blocks = _draft_rounds(drafter, seed=4, rounds=3)
        return blocks, drafter.context.k.clone(), drafter.context.v.clone()

    from torch._dynamo.utils import counters

    eager, eager_k, eager_v = rounds(False)
    counters.clear()
    try:
        compiled, k, v = rounds(True)
    finally:
        drafter.compile_layers(False)
    # each block one graph: a break would split a layer into eager pieces
    assert not counters["graph_break"], dict(counters["graph_break"])
    # three rounds of 16 rows through the compiled block, one call a layer
    assert observed == [16] * (3 * len(drafter.layers))
    assert_rel(k, eager_k, TOL, "context keys")
    assert_rel(v, eager_v, TOL, "context values")
    for e, c in zip(eager, compiled):
        assert torch.equal(e.tokens, c.tokens)
        # fusion reorders the fp32 arithmetic
        assert_rel(c.confidence, e.confidence, TOL, "confidence")
        assert_rel(c.entropy, e.entropy, TOL, "entropy")


def test_fused_projections_draft_what_separate_ones_do_and_save_unshared(tmp_path):
    """`reset` fuses each layer's q/k/v and gate/up projections (`hybridspec.fused`): the drafts
    equal those of the separate linears, the parameters are views of the fused weights (listed in
    `static_buffers`), and `save_pretrained` writes them as tensors of their own."""
    drafter = random_drafter(config(**SLIDING)).bind(qwen35_causal_lm())

    def unfuse():
        for layer in drafter.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fused_mod.unfuse_group(attn, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj))
            fused_mod.unfuse_group(mlp, "gate_up", (mlp.gate_proj, mlp.up_proj))

    def rounds(fused):
        return _draft_rounds(drafter, seed=6, rounds=2, after_reset=None if fused else unfuse)

    fused = rounds(True)
    attn = drafter.layers[0].self_attn
    stacked = fused_mod.fused_weight(attn, "qkv")
    assert stacked is not None and attn.k_proj.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    assert any(t is stacked for t in drafter.static_buffers())
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    separate = rounds(False)
    assert fused_mod.fused_weight(attn, "qkv") is None
    for f, e in zip(fused, separate):
        assert torch.equal(f.tokens, e.tokens)
        assert_rel(f.confidence, e.confidence, TOL, "confidence")
        assert_rel(f.entropy, e.entropy, TOL, "entropy")


def test_training_after_drafting_reaches_every_projection():
    """After drafting fused the projections, the stateless forward (training) still runs the
    linears: every projection gets its gradient."""
    drafter = random_drafter(config()).bind(qwen35_causal_lm())
    _draft_rounds(drafter, seed=7, rounds=1)
    assert fused_mod.fused_weight(drafter.layers[0].self_attn, "qkv") is not None
    args = (torch.randn(1, 7, len(TAPS) * HIDDEN), torch.randn(1, 16, HIDDEN), torch.arange(23)[None])
    drafter(*args).square().sum().backward()
    for layer in drafter.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                    layer.mlp.gate_proj, layer.mlp.up_proj):
            assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


def test_drafting_reads_no_length_on_the_host():
    """On the meta device any host read of a tensor value raises."""
    with torch.device("meta"):
        drafter = DFlashDrafter(DFlashConfig.from_dict(config(**SLIDING)))
        target = qwen35_causal_lm()
    drafter.bind(target).reset(2, max_length=100)
    with torch.device("meta"):
        drafter.observe(torch.randn(2, 30, len(TAPS) * HIDDEN), torch.full((2,), 30))
        for _ in range(3):
            block = drafter.propose(torch.zeros(2, dtype=torch.long))
            drafter.observe(torch.randn(2, 16, len(TAPS) * HIDDEN), torch.ones(2, dtype=torch.long))
    assert block.tokens.shape == block.confidence.shape == block.entropy.shape == (2, 15)


def test_save_reload_roundtrip(tmp_path):
    drafter = random_drafter(config(**SLIDING))
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.config.to_dict() == drafter.config.to_dict()
    assert loaded.state_dict().keys() == drafter.state_dict().keys()
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    args = (torch.randn(1, 7, len(TAPS) * HIDDEN), torch.randn(1, 16, HIDDEN), torch.arange(23)[None])
    with torch.no_grad():
        assert torch.equal(loaded(*args), drafter(*args))
    half = DFlashDrafter.from_pretrained(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.rotary_emb.inv_freq.dtype == torch.float32


def test_block_size_from_dflash_config_then_top_level(tmp_path):
    both = config(dflash_config=dict(BASE["dflash_config"], block_size=4), block_size=8)
    assert DFlashConfig.from_dict(both).block_size == 4
    assert DFlashConfig.from_dict(config(block_size=8)).block_size == 8
    neither = config()
    del neither["block_size"]
    assert DFlashConfig.from_dict(neither).block_size == 16
    random_drafter(config(block_size=8)).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["block_size"] == 8 and "block_size" not in saved["dflash_config"]
    assert DFlashDrafter.from_pretrained(tmp_path).block_size == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=32), "hidden size: drafter 32, target 64"),
        (dict(vocab_size=200), f"vocab size: drafter 200, target {VOCAB}"),
        (dict(dflash_config={"target_layer_ids": [0, 4], "mask_token_id": 5}),
         r"target_layer_ids \[0, 4\]: \[4\] out of range for a target with 4 layers"),
        (dict(dflash_config={"target_layer_ids": [-1], "mask_token_id": 5}), r"\[-1\] out of range"),
        (dict(block_size=17), "block_size 17 > 16"),
        (dict(dflash_config={"target_layer_ids": TAPS, "mask_token_id": VOCAB}),
         f"mask_token_id {VOCAB} >= target vocab size {VOCAB}"),
    ],
)
def test_bind_rejects_a_mismatched_target(overrides, message):
    drafter = DFlashDrafter(DFlashConfig.from_dict(config(**overrides)))
    with pytest.raises(ValueError, match=message):
        drafter.bind(qwen35_causal_lm())


def test_drafting_needs_bind_and_start():
    drafter = DFlashDrafter(DFlashConfig.from_dict(config()))
    with pytest.raises(RuntimeError, match="bind"):
        drafter.embed(torch.zeros(1, 1, dtype=torch.long))
    drafter.bind(qwen35_causal_lm())
    with pytest.raises(RuntimeError, match="start"):
        drafter.propose(torch.zeros(1, dtype=torch.long))
    drafter.reset(1)
    with pytest.raises(ValueError, match="num_commit must be in 0..3"):
        drafter.observe(torch.zeros(1, 3, len(TAPS) * HIDDEN), 4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "unsupported rope_type 'dynamic'"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
         "partial_rotary_factor=0.5"),
        (dict(layer_types=["full_attention", "linear_attention"]), r"unsupported drafter layer_types \['linear_attention'\]"),
        (dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8),
         "no sliding window is in effect"),
        (dict(architectures=["DFlash2DraftModel"]), "DFlash 2 checkpoints"),
        (dict(dflash_config={"target_layer_ids": TAPS, "mask_token_id": 5, "conv_kernel_size": 4}),
         "unsupported DFlash variant: config sets conv_kernel_size"),
        (dict(dflash_config={"target_layer_ids": TAPS}), "mask_token_id must be a non-negative int"),
        (dict(dflash_config={"mask_token_id": 5}, num_target_layers=None), "names no taps"),
        (dict(block_size=1), "block_size must be an int >= 2"),
    ],
)
def test_unsupported_config_raises(overrides, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_dict({k: v for k, v in config(**overrides).items() if v is not None})


def test_taps_default_to_the_reference_rule():
    raw = config(dflash_config={"mask_token_id": 5}, num_target_layers=40, num_hidden_layers=5)
    assert DFlashConfig.from_dict(raw).target_layer_ids == (1, 10, 19, 28, 37)
