"""The `hybridspec` command line (`hybridspec ...` or `python -m hybridspec ...`)."""

from __future__ import annotations

import argparse
import sys

from hybridspec.training import cli as training_cli


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


def _bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="the end-to-end table: AR, transformers' static AR, vanilla DFlash and every length policy",
        description="Decode the same prompts with every method side by side and print the table (also JSON and PNG "
                    "plots under --out). With a replay drafter (default for --shape and --tiny) acceptance is "
                    "simulated and labelled so.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--target", help="local target model directory")
    what.add_argument("--shape", choices=["qwen3.6-35b-a3b"], help="a full-size shape with random bf16 weights (GPU)")
    what.add_argument("--tiny", action="store_true", help="the tiny random models (a smoke test; runs on the CPU)")
    p.add_argument("--drafter", help="local DFlash drafter directory (default for --shape: random weights of the "
                                     "real drafters' shape)")
    p.add_argument("--replay", action="store_true", help="simulated acceptance over the drafter's cost")
    p.add_argument("--unforced", action="store_true",
                   help="with --shape: accept by the target's own argmax (random bf16 weights rarely reproduce their "
                        "AR continuation, so acceptance collapses) instead of forcing the replayed accept lengths")
    p.add_argument("--prompts", help="JSONL prompts (seeded split: calibration / evaluation halves); default: "
                                     "random token prompts")
    p.add_argument("--tokenizer", help="tokenizer directory for --prompts")
    p.add_argument("--calibration", help="a calibration artifact (default: calibrate here, on other prompts and seed)")
    p.add_argument("--out", default="bench_out", help="directory for bench.json and the plots")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=512, help="length of the random prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--calibration-tokens", type=int, default=64, help="new tokens per calibration prompt")
    p.add_argument("--skip-transformers", action="store_true", help="leave out transformers' static AR (~90 s compile)")
    p.add_argument("--seed", type=int, default=0, help="evaluation draws; calibration uses seed + 1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _calibrate_parser(sub)
    _bench_parser(sub)
    training_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "train-drafter":
        return training_cli.run(args)
    if args.command == "bench":
        from hybridspec.bench import run

        for name in ("num_prompts", "prompt_tokens", "max_new_tokens", "calibration_tokens"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be positive")
        run(args)
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
