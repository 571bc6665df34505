"""Training data for a DFlash drafter: corpus texts, prompt windows, the target's own greedy
continuations (the DFlash recipe regenerates responses with the target) and its tap features."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hybridspec.round.prefill import tap_features as taps_of

TEXT_KEYS = ("text", "prompt")


def read_texts(path: str | Path) -> list[str]:
    """The texts of a corpus: a .jsonl file (each row's `text` or `prompt`), any other file (one
    text), or a directory of such files (recursively, sorted by path). Empty texts are dropped."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return [t for f in files for t in read_texts(f)]
    if path.suffix != ".jsonl":
        text = path.read_text(encoding="utf-8", errors="replace")
        return [text] if text.strip() else []
    texts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            key = next((k for k in TEXT_KEYS if isinstance(row, dict) and isinstance(row.get(k), str)), None)
            if key is None:
                raise ValueError(f"{path}:{lineno}: a corpus row needs a string `text` or `prompt`")
            if row[key].strip():
                texts.append(row[key])
    return texts


def is_heldout(text: str, percent: float) -> bool:
    """Held out by content hash: the same text is on the same side in every run and machine."""
    digest = int.from_bytes(hashlib.sha256(text.encode("utf-8", errors="replace")).digest()[:8], "big")
    return digest % 10_000 < percent * 100


def prompt_windows(tokenizer, texts: list[str], count: int, length: int, seed: int, chunk: int = 512) -> torch.Tensor:
    """`[n, length]` token windows (n <= count) at seeded random offsets: texts in a seeded order,
    one window per text of at least `length` tokens, cycling over them until `count` windows.
    Texts are tokenised in chunks, only as far as the windows need."""
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    eligible: list[list[int]] = []
    windows: list[list[int]] = []
    for i in range(0, len(order), chunk):
        batch = [texts[j] for j in order[i : i + chunk]]
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            if len(ids) >= length:
                eligible.append(ids)
                start = rng.randrange(len(ids) - length + 1)
                windows.append(ids[start : start + length])
        if len(windows) >= count:
            break
    while eligible and len(windows) < count:
        ids = eligible[len(windows) % len(eligible)]
        start = rng.randrange(len(ids) - length + 1)
        windows.append(ids[start : start + length])
    if not windows:
        raise ValueError(f"no corpus text has {length} tokens: shorten --prompt-tokens or add texts")
    return torch.tensor(windows[:count], dtype=torch.long)


@torch.no_grad()
def regenerate(model, prompts: torch.Tensor, new_tokens: int, batch: int, eos_token_id, pad_token_id,
               desc: str = "regenerate") -> tuple[torch.Tensor, torch.Tensor]:
    """The target's greedy continuations of equal-length prompts `[n, P]`: sequences `[n, P + R]`
    (padded with `pad_token_id` after an early stop) and each row's end `[n]` (one past its EOS,
    or P + R). Batched `generate` without padding, since every prompt has P tokens."""
    device = next(model.parameters()).device
    n, P = prompts.shape
    out = torch.full((n, P + new_tokens), pad_token_id, dtype=torch.long)
    for i in tqdm(range(0, n, batch), desc=desc, unit="batch"):
        ids = prompts[i : i + batch].to(device)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        out[i : i + batch, : seq.shape[1]] = seq.cpu()
    end = torch.full((n,), P + new_tokens, dtype=torch.long)
    if eos_token_id is not None:
        is_eos = out[:, P:] == eos_token_id
        first = is_eos.float().argmax(dim=1)
        end = torch.where(is_eos.any(dim=1), P + first + 1, end)
    return out, end


@torch.no_grad()
def tap_features(model, input_ids: torch.Tensor, layer_ids, batch: int, device, dtype) -> torch.Tensor:
    """The target's taps `[n, T, len(layer_ids) * H]` (tap i = `hidden_states[i + 1]`, as the
    prefill hands them to the drafter), in `dtype` on `device`."""
    feats = []
    for i in tqdm(range(0, input_ids.shape[0], batch), desc="target taps", unit="batch"):
        ids = input_ids[i : i + batch].to(next(model.parameters()).device)
        out = model(ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        feats.append(taps_of(out.hidden_states, layer_ids).to(device=device, dtype=dtype))
    return torch.cat(feats)
