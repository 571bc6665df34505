"""Calibration prompts: loading, the seeded calibration / held-out split, rendering to token ids.

A prompts file is JSONL, one object per line (blank lines skipped), each with exactly one of

- `prompt`: text, tokenised as it is;
- `turns`: a list of user turns (strings) or chat messages (`{"role", "content"}`), rendered with
  the tokenizer's chat template;
- `messages`: chat messages (`{"role", "content"}`),

and optionally `category` (a string) and `id` or `question_id`. Other fields are ignored.

SPEED-Bench rows load as they are. The dataset (`nvidia/SPEED-Bench` on the Hugging Face hub) has
the columns `question_id`, `category`, `sub_category`, `turns` (a list of strings), `source`,
`src_id`, `difficulty` and `multiturn`; its prompts go in as successive user turns and its
`category` is the row's category. Part of the public release is masked: such a row's first turn
starts with `SPEED_BENCH_PLACEHOLDER` and its text has to be fetched from the original sources
with NVIDIA's specdec_bench (`prepare_data.py`) first; loading a masked row raises, because
calibrating on the placeholder would measure the acceptance of one repeated sentence. The JSONL
that aiperf reads for SPEED-Bench (`question_id`, `category`, `messages`) loads as well.

Without a tokenizer for the target, `load_tokenizer` falls back to `ByteTokenizer`: one token per
UTF-8 byte, no download, no chat template.
"""

from __future__ import annotations

import json
import math
import os
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

SPEED_BENCH_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
TEXT_FIELDS = ("prompt", "turns", "messages")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class Prompt:
    """One calibration prompt: either `text`, or `turns` (chat messages as `{"role", "content"}`
    dicts, or plain strings, each a successive user turn). `id` is the row's `id` or
    `question_id`, else `FILE:LINE`."""

    text: str | None
    turns: tuple[str | dict[str, str], ...] | None
    category: str | None
    id: str


def load_prompts(path: str | os.PathLike) -> list[Prompt]:
    """The prompts of a JSONL file, in file order. Raises `ValueError` naming the file and line
    for a line that is not a JSON object, a row with none (or more than one) of `prompt`,
    `turns`, `messages`, a malformed value, a masked SPEED-Bench row, or a file without rows."""
    path = Path(path)
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            prompts.append(_parse_row(row, where, default_id=f"{path.name}:{lineno}"))
    if not prompts:
        raise ValueError(f"{path}: no prompts (the file is empty or has only blank lines)")
    return prompts


def _parse_row(row: dict[str, Any], where: str, default_id: str) -> Prompt:
    present = [k for k in TEXT_FIELDS if k in row]
    if len(present) != 1:
        found = f"it has {', '.join(present)}" if present else f"its keys are {sorted(row)}"
        raise ValueError(f"{where}: a row needs exactly one of {', '.join(TEXT_FIELDS)}; {found}")
    key = present[0]
    category = row.get("category")
    if category is not None and not isinstance(category, str):
        raise ValueError(f"{where}: `category` must be a string, got {type(category).__name__}")
    row_id = row.get("id", row.get("question_id"))
    row_id = default_id if row_id is None else str(row_id)
    if key == "prompt":
        text = row["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: `prompt` must be a non-empty string")
        return Prompt(text=text, turns=None, category=category, id=row_id)
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: `{key}` must be a non-empty list")
    parsed = tuple(_parse_turn(turn, key, i, where) for i, turn in enumerate(turns))
    if not any(isinstance(t, str) or t["role"] == "user" for t in parsed):
        raise ValueError(f"{where}: `{key}` has no user message")
    if any((t if isinstance(t, str) else t["content"]).startswith(SPEED_BENCH_PLACEHOLDER) for t in parsed):
        raise ValueError(
            f"{where}: a masked SPEED-Bench row (its text is a placeholder); fetch the prompts from "
            "their sources with specdec_bench's prepare_data.py and load its output instead"
        )
    return Prompt(text=None, turns=parsed, category=category, id=row_id)


def _parse_turn(turn: Any, key: str, i: int, where: str) -> str | dict[str, str]:
    if isinstance(turn, str) and key == "turns":
        if not turn.strip():
            raise ValueError(f"{where}: `{key}[{i}]` is empty")
        return turn
    if isinstance(turn, dict):
        role, content = turn.get("role"), turn.get("content")
        if isinstance(role, str) and role and isinstance(content, str) and content.strip():
            return {"role": role, "content": content}
    expected = "a string or " if key == "turns" else ""
    raise ValueError(
        f"{where}: `{key}[{i}]` must be {expected}an object with a string `role` and a non-empty "
        f"string `content`, got {json.dumps(turn)[:80]}"
    )


def split_prompts(prompts: Sequence[Prompt], seed: int = 0) -> tuple[list[Prompt], list[Prompt]]:
    """(calibration, held_out): a seeded shuffle puts ceil(n / 2) prompts in the calibration half
    and the rest in the held-out half; each half keeps file order. The shuffle draws only on
    `random.Random(seed).random()`, whose sequence Python guarantees across versions
    (`random.shuffle` has no such guarantee)."""
    n = len(prompts)
    if n == 0:
        raise ValueError("no prompts to split")
    rng = random.Random(seed)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        order[i], order[j] = order[j], order[i]
    chosen = set(order[: math.ceil(n / 2)])
    calibration = [p for i, p in enumerate(prompts) if i in chosen]
    held_out = [p for i, p in enumerate(prompts) if i not in chosen]
    return calibration, held_out


_warned_no_template = False


def render(prompt: Prompt, tokenizer) -> torch.Tensor:
    """Token ids `[1, n]` (int64) of a prompt.

    A text prompt is tokenised as it is (with the tokenizer's own special tokens, if it adds
    any). Turns become chat messages (a string is a user message) up to the last user message:
    later assistant messages are replies, not prompt. With a chat template they are rendered by
    `apply_chat_template(..., add_generation_prompt=True)`; without one the contents are joined
    with newlines (warned once). A multi-turn prompt is rendered whole, its user turns as
    successive messages: SPEED-Bench's harness instead sends turn k after the target's replies
    to turns 1..k-1, which exist only after generating; rendering every user turn at once keeps
    all the prompt's text in one prefill. Raises `ValueError` if the result has no tokens."""
    global _warned_no_template
    if prompt.text is not None:
        ids = tokenizer(prompt.text)["input_ids"]
    else:
        messages = [{"role": "user", "content": t} if isinstance(t, str) else dict(t) for t in prompt.turns]
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages = messages[: last_user + 1]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # the template writes any BOS itself
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            if not _warned_no_template:
                warnings.warn(
                    "hybridspec: the tokenizer has no chat template; chat prompts are rendered as "
                    "their messages' contents joined with newlines",
                    stacklevel=2,
                )
                _warned_no_template = True
            ids = tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    if len(ids) == 0:
        raise ValueError(f"prompt {prompt.id!r} renders to no tokens")
    return torch.tensor([ids], dtype=torch.long)


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte 0..255, the
    form `tokenizers`' ByteLevel normalizer and decoder use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


class ByteTokenizer(PreTrainedTokenizerFast):
    """The built-in fallback tokenizer: each UTF-8 byte of the text is one token, id = byte value
    mod `vocab_size`. No download, no special tokens, no chat template.

    For `vocab_size >= 256` ids 0..255 are the bytes and decoding is exact. A smaller vocabulary
    (the tiny test targets have 128) folds byte b onto id b mod `vocab_size`: every id stays valid
    for the target, ASCII still round-trips when `vocab_size >= 128`, and other bytes decode to
    the byte they fold onto. Calibration needs only token ids, so the loss is harmless there.
    Not meant to be saved and reloaded: `AutoTokenizer` does not know this class."""

    def __init__(self, vocab_size: int = 256, **kwargs):
        from tokenizers import Tokenizer, decoders, models, normalizers

        if vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")
        chars = _byte_chars()
        n = min(vocab_size, 256)
        backend = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(n)}, merges=[]))
        # the ByteLevel normalizer spells every byte as one alphabet character; a BPE model
        # without merges then makes each character its own token, and the folds map the
        # characters of bytes past the vocabulary onto those of their ids
        folds = [normalizers.Replace(chars[b], chars[b % vocab_size]) for b in range(n, 256)]
        backend.normalizer = normalizers.Sequence([normalizers.ByteLevel(), *folds])
        backend.decoder = decoders.ByteLevel()
        kwargs.pop("tokenizer_object", None)
        super().__init__(tokenizer_object=backend, **kwargs)


def load_tokenizer(tokenizer_dir: str | os.PathLike | None, target_dir: str | os.PathLike | None,
                   vocab_size: int):
    """The tokenizer for calibration prompts: `tokenizer_dir` if given, else the target's
    directory if it holds tokenizer files, else `ByteTokenizer(vocab_size)` with a warning that
    says why. Raises `ValueError` if the tokenizer has ids the target's `vocab_size` lacks."""
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    elif target_dir is not None and any((Path(target_dir) / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    else:
        if target_dir is None:
            why = "no --tokenizer given and the target has no directory"
        else:
            why = f"no --tokenizer given and {target_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)})"
        warnings.warn(
            f"hybridspec: {why}; using the built-in byte-level tokenizer (one token per UTF-8 byte, "
            "no chat template). Acceptance measured on its tokens may differ from the target's "
            "real tokenizer: pass --tokenizer DIR.",
            stacklevel=2,
        )
        return ByteTokenizer(vocab_size)
    top = max(tokenizer.get_vocab().values())
    if top >= vocab_size:
        raise ValueError(
            f"the tokenizer has ids up to {top}, past the target's vocabulary of {vocab_size}: "
            "it is not this target's tokenizer"
        )
    return tokenizer
