"""The pair's corpus: the Python source files of this machine's standard library and site-packages.

Deterministic: the roots and the files under them are sorted by path; files are deduplicated by
content (the first path in sorted order names a file); the held-out split is by content hash
(`hybridspec.training.data.is_heldout`, the split `hybridspec train-drafter` uses too).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import site
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from hybridspec.training.data import is_heldout

HELDOUT_PERCENT = 2.0
# larger files are mostly generated tables and data, not code people write
MAX_FILE_BYTES = 512_000
# the seeded sample of training files `hybridspec train-drafter` reads (train_target.py writes it too)
DRAFTER_CORPUS_BYTES = 24_000_000


@dataclass
class Corpus:
    train: list[str] = field(default_factory=list)
    heldout: list[str] = field(default_factory=list)
    heldout_names: list[str] = field(default_factory=list)
    files: int = 0
    duplicates: int = 0
    skipped: int = 0
    bytes: int = 0


def roots() -> list[Path]:
    paths = sysconfig.get_paths()
    candidates = {paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()}
    return sorted(Path(p).resolve() for p in candidates if p and os.path.isdir(p))


def source_files(max_files: int | None = None) -> list[tuple[str, Path]]:
    """(name, path) of every `.py` file under the roots, sorted; a file under two roots once."""
    seen, out = set(), []
    for root in roots():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath, name)
                if not name.endswith(".py") or not path.is_file():
                    continue
                real = path.resolve()
                if real in seen:
                    continue
                seen.add(real)
                out.append((f"{root.name}/{path.relative_to(root)}", path))
    out.sort(key=lambda item: str(item[1]))
    return out[:max_files] if max_files else out


def build(max_files: int | None = None) -> Corpus:
    corpus, hashes = Corpus(), set()
    for name, path in source_files(max_files):
        corpus.files += 1
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            corpus.skipped += 1
            continue
        if not text.strip() or len(raw) > MAX_FILE_BYTES:
            corpus.skipped += 1
            continue
        digest = hashlib.sha256(raw).digest()
        if digest in hashes:
            corpus.duplicates += 1
            continue
        hashes.add(digest)
        corpus.bytes += len(raw)
        if is_heldout(text, HELDOUT_PERCENT):
            corpus.heldout.append(text)
            corpus.heldout_names.append(name)
        else:
            corpus.train.append(text)
    return corpus


def heldout_prompts(corpus: Corpus, count: int = 64, seed: int = 0, min_chars: int = 256,
                    max_chars: int = 640) -> list[dict]:
    """`count` prompts from distinct held-out files: whole lines from a seeded random line on,
    at least `min_chars` (and at most `max_chars`) characters, ending at a line end."""
    rng = random.Random(seed)
    order = list(range(len(corpus.heldout)))
    rng.shuffle(order)
    prompts = []
    for i in order:
        lines = corpus.heldout[i].splitlines(keepends=True)
        if sum(map(len, lines)) < 2 * min_chars:
            continue
        start = rng.randrange(len(lines))
        text = ""
        for line in lines[start:]:
            if len(text) + len(line) > max_chars:
                break
            text += line
            if len(text) >= min_chars:
                break
        if len(text) >= min_chars and text.strip():
            prompts.append({"prompt": text, "id": corpus.heldout_names[i], "category": "python"})
        if len(prompts) == count:
            break
    return prompts


def sample_texts(texts: list[str], max_bytes: int, seed: int) -> list[str]:
    """A seeded sample of texts up to `max_bytes` (UTF-8), for `train-drafter`'s corpus."""
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    out, size = [], 0
    for i in order:
        size += len(texts[i].encode("utf-8"))
        if size > max_bytes:
            break
        out.append(texts[i])
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--max-files", type=int, default=None, help="first N source files only (dry runs)")
    p.add_argument("--drafter-corpus", default=None, help="write the drafter's corpus sample (JSONL) here, "
                                                           "as train_target.py does")
    p.add_argument("--drafter-corpus-bytes", type=int, default=DRAFTER_CORPUS_BYTES)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    c = build(args.max_files)
    print(json.dumps({"roots": [str(r) for r in roots()], "files": c.files, "duplicates": c.duplicates,
                      "skipped": c.skipped, "bytes": c.bytes, "train": len(c.train), "heldout": len(c.heldout)}))
    if args.drafter_corpus:
        texts = sample_texts(c.train, args.drafter_corpus_bytes, args.seed)
        write_jsonl(Path(args.drafter_corpus), [{"text": t} for t in texts])


if __name__ == "__main__":
    main()
