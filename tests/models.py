"""Tiny random targets for CPU tests: 3 GDN : 1 attention layers, GVA 2:1, several experts, top-k 2."""

from __future__ import annotations

import tempfile

import torch
from transformers import (
    AutoModelForImageTextToText,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)

from hybridspec.tiny import DRAFTER as BASE
from hybridspec.tiny import TARGET as TEXT
from hybridspec.tiny import VOCAB, tiny_next_target, tiny_target
from hybridspec.tiny import drafter_config as config
from hybridspec.tiny import tiny_drafter as random_drafter

TAPS = BASE["dflash_config"]["target_layer_ids"]


def qwen35_causal_lm(seed: int = 0) -> Qwen3_5MoeForCausalLM:
    return tiny_target(seed)


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
    return tiny_next_target(seed)




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
