"""The `hybridspec train-drafter` subcommand. Imports nothing heavy at module level: `hybridspec
--help` builds this parser; torch and transformers load inside `run`."""

from __future__ import annotations

import argparse
import json

from hybridspec.training.options import option_fields

DESCRIPTION = (
    "Train a DFlash drafter for a transformers target with the DFlash recipe: the target's own greedy "
    "continuations of corpus prompt windows with its tap features; random anchors per response, blocks "
    "[anchor, mask...] attending bidirectionally inside the block, cross-entropy of block position k "
    "weighted exp(-(k-1)/gamma); the target's embedding and LM head shared and frozen; AdamW, warm-up + "
    "cosine, clipping, bf16 autocast on CUDA; seeded. Writes a z-lab format checkpoint "
    "(DFlashDrafter.from_pretrained) and report.json with the held-out mean acceptance length of real "
    "speculative runs (generate(..., hybridspec=True)), greedy and temperature 1."
)


def _type(annotation: str):
    # annotations are strings (`from __future__ import annotations`): "int | None" -> int
    name = annotation.split("|")[0].strip()
    return {"int": int, "float": float, "str": str}[name]


HELP = "train a DFlash drafter for a target (DFlash recipe)"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every option of `train-drafter` (from `hybridspec.training.options`)."""
    for name, annotation, default, help, required in option_fields():
        flag = "--" + name.replace("_", "-")
        if required:
            p.add_argument(flag, type=_type(annotation), required=True, default=argparse.SUPPRESS, help=help)
        else:
            p.add_argument(flag, type=_type(annotation), default=default, help=help)
    return p


def run(args: argparse.Namespace) -> int:
    from hybridspec.training.train import train_drafter

    options = {name: getattr(args, name) for name, *_ in option_fields()}
    report = train_drafter(**options)
    summary = {k: report[k] for k in ("steps", "sequences", "data_seconds", "train_seconds") if k in report}
    summary["final"] = report["history"][-1] if report["history"] else None
    summary["acceptance"] = report.get("acceptance")
    print(json.dumps(summary, indent=2))
    return 0
