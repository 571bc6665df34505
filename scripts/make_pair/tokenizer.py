"""The pair's tokenizer: byte-level BPE trained with `tokenizers`, saved as a transformers tokenizer.

The pipeline is exactly the one transformers' `Qwen3_5Tokenizer` builds around a BPE vocabulary
(NFC, the Qwen split regex, byte level without prefix space, no post-processor), because
`AutoTokenizer.from_pretrained` on a directory whose config is a Qwen3.5 model rebuilds the
tokenizer as that class from `tokenizer.json`'s vocabulary and merges: with the same pipeline both
give the same ids. Ids 0..2 are reserved: EOS `<|endoftext|>` (also the class's default unknown
token, so nothing is added past the vocabulary), pad `<|pad|>`, and the drafter's mask `<|mask|>`.
"""

from __future__ import annotations

import random

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# transformers.models.qwen3_5.tokenization_qwen3_5.PRETOKENIZE_REGEX (5.17 and 5.24)
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
EOS, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL = [EOS, PAD, MASK]


def pipeline(tok: Tokenizer) -> Tokenizer:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train(texts: list[str], vocab_size: int = 8192, max_bytes: int = 40_000_000, seed: int = 0) -> Tokenizer:
    """BPE on a seeded sample of `texts` of at most `max_bytes`."""
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    sample, size = [], 0
    for i in order:
        if size + len(texts[i]) > max_bytes:
            break
        sample.append(texts[i])
        size += len(texts[i])
    tok = pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample, trainer, length=len(sample))
    return tok


def save(tok: Tokenizer, directory: str) -> None:
    """As a transformers tokenizer (tokenizer.json + tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, mask_token=MASK,
                                   unk_token=EOS, model_max_length=1 << 20)
    fast.save_pretrained(directory)


def check_auto(directory: str, tok: Tokenizer, texts: list[str]) -> dict:
    """`AutoTokenizer.from_pretrained(directory)` against `tok` on `texts`: its class, the special
    ids, the largest id, and how many texts encode differently (must be 0)."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(directory)
    ours = [e.ids for e in tok.encode_batch(texts)]
    theirs = auto(texts, add_special_tokens=True)["input_ids"]
    return {"class": type(auto).__name__, "eos": auto.eos_token_id, "pad": auto.pad_token_id,
            "mask": auto.mask_token_id, "max_id": max(auto.get_vocab().values()),
            "mismatches": sum(a != b for a, b in zip(ours, theirs))}
