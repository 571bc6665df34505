"""Tiny random targets for CPU tests: 3 GDN : 1 attention layers, GVA 2:1, several experts, top-k 2."""

from __future__ import annotations

import json
import tempfile

import torch
from hybridspec.drafter import DFlashConfig, DFlashDrafter
from transformers import (
    AutoModelForImageTextToText,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
)

VOCAB = 128

TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)


def qwen35_causal_lm(seed: int = 0) -> Qwen3_5MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TEXT)).eval()


def qwen35_checkpoint_layout(seed: int = 0) -> Qwen3_5MoeForConditionalGeneration:
    """The layout of the real checkpoints, saved and loaded back through `from_pretrained`."""
    torch.manual_seed(seed)
    config = Qwen3_5MoeConfig(
        text_config=TEXT,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64),
    )
    model = Qwen3_5MoeForConditionalGeneration(config)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()


def qwen3_next_causal_lm(seed: int = 0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(**{k: v for k, v in TEXT.items() if k != "shared_expert_intermediate_size"},
                             shared_expert_intermediate_size=32, intermediate_size=64)
    return Qwen3NextForCausalLM(config).eval()


TAPS = [0, 2, 3]
# A DFlash drafter config in the z-lab checkpoint format, matching the tiny targets above.
BASE = dict(
    vocab_size=VOCAB, hidden_size=TEXT["hidden_size"], intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
    num_target_layers=TEXT["num_hidden_layers"], block_size=16,
    dflash_config={"target_layer_ids": TAPS, "mask_token_id": VOCAB - 3},
)

def config(**overrides) -> dict:
    raw = json.loads(json.dumps(BASE))
    raw.update(overrides)
    return raw


def random_drafter(raw: dict, seed: int = 0) -> DFlashDrafter:
    """Weights far from their initialisation, so that drafts differ from position to position:
    sharp attention (large q/k norm gains) and, through the target's small random LM head, peaked
    draft distributions (large final norm gain)."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DFlashConfig.from_dict(raw))
    gain = {"q_norm": 4.0, "k_norm": 4.0, "norm": 30.0}
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() > 1 or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3)
            else:
                p.copy_((torch.rand_like(p) + 0.5) * gain.get(name.split(".")[-2], 1.0))
    return drafter.eval()


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocab: id 0 `<pad>`, 1 `<eos>`, id i >= 2 the word `w{i}`.
    Words carry their leading space (byte-level `Ġ`), so decoding new tokens alone, as the
    text-generation pipeline does, keeps the space before them. Adds no BOS. An unknown word raises
    (no unk token), and decoding with `skip_special_tokens` drops ids 0 and 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"Ġw{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
