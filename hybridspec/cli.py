"""The `hybridspec` command line (`hybridspec ...` or `python -m hybridspec ...`)."""

from __future__ import annotations

import argparse
import sys


def _calibrate_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="fit the length policy of a target + drafter pair on this machine",
        description="Fit the acceptance model, cost curve, routing-correction tables and rho of the "
                    "HybridSpec length policy, and write them as a JSON artifact for "
                    "generate(..., calibration=path). Uses the calibration half of the prompts (seeded split).")
    p.add_argument("--target", required=True, help="local target model directory")
    p.add_argument("--drafter", required=True,
                   help="local DFlash drafter directory, or replay:DIR for that drafter's cost with simulated acceptance")
    p.add_argument("--prompts", required=True, help="JSONL prompts (prompt text or chat turns, optional category)")
    p.add_argument("--out", required=True, help="where to write the calibration JSON")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the target's, else a byte-level one)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--lengths", default="2,4,6,8,12,16", help="verification lengths timed for the cost curve")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompt split and the replay draws")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _calibrate_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "calibrate":
        import torch

        from hybridspec.calibration.run import calibrate

        try:
            lengths = tuple(sorted({int(x) for x in args.lengths.split(",") if x.strip()}))
        except ValueError:
            parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        calibrate(target=args.target, drafter=args.drafter, prompts=args.prompts, out=args.out,
                  tokenizer=args.tokenizer, max_new_tokens=args.max_new_tokens, device=device, lengths=lengths,
                  seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
