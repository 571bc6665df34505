"""The `hybridspec` command line (`hybridspec ...` or `python -m hybridspec ...`).

Subcommands live in `COMMANDS`: each names a function that adds its arguments (it must not import
torch or transformers, so that `hybridspec --help` stays fast) and, as "module:function", the code
that runs it, imported only when that subcommand runs. A new subcommand (e.g. `train-drafter`) is
one more entry.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Callable

from hybridspec.training import cli as training_cli


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default, except where there is nothing to show (flags that are off, and
    options whose default depends on other options: their help text says what it is)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def repeats_count(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError("at least 2 repeats: one timing has no spread to judge it by")
    return value


def lengths_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


CPU_THREADS_HELP = ("torch intra-op threads when the device is the CPU: tiny models are overhead-bound, and more "
                    "threads contend with scikit-learn's OpenMP runtime, which made timings swing 10-100x on 2 cores")


def _calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="local target model directory")
    p.add_argument("--drafter", required=True,
                   help="local DFlash drafter directory, or replay:DIR for that drafter's cost with simulated acceptance")
    p.add_argument("--prompts", required=True, help="JSONL prompts (prompt text or chat turns, optional category)")
    p.add_argument("--out", required=True, help="where to write the calibration JSON")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the target's, else a byte-level one)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="new tokens per prompt (default: 64 on CUDA, 32 on the CPU)")
    p.add_argument("--lengths", type=lengths_list, default=None,
                   help="verification lengths timed for the cost curve (default: 2,4,6,8,12,16 on CUDA, 2,4,8,16 on "
                        "the CPU)")
    p.add_argument("--timed-prompts", type=positive_int, default=None,
                   help="prompts timed per length, after one warm-up prompt (default: every calibration prompt on "
                        "CUDA, 3 on the CPU)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompt split and the replay draws")
    p.add_argument("--cpu-threads", type=positive_int, default=1, help=CPU_THREADS_HELP)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1], choices=[1, 2, 4],
                   help="batch sizes to measure: each size beyond 1 adds its batched round times, rho, routing "
                        "means and best fixed length (batched generate needs its size; a batch of 3 uses 4)")


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--target", help="local target model directory")
    what.add_argument("--shape", choices=["qwen3.6-35b-a3b"], help="a full-size shape with random bf16 weights (GPU)")
    what.add_argument("--tiny", action="store_true",
                      help="the tiny random models: a CPU smoke test of every row; its tokens/s say nothing about "
                           "speedups (tiny models are overhead-bound on a CPU)")
    p.add_argument("--drafter", help="local DFlash drafter directory (default for --shape: random weights of the "
                                     "real drafters' shape)")
    p.add_argument("--replay", action="store_true", help="simulated acceptance over the drafter's cost")
    p.add_argument("--traces", default=None,
                   help="an acceptance trace recorded from a real pair (scripts/record_traces.py): the replay drafter "
                        "replays its rounds in order instead of drawing from the synthetic Beta(5, 2) model")
    p.add_argument("--unforced", action="store_true",
                   help="with --shape: accept by the target's own argmax (random bf16 weights rarely reproduce their "
                        "AR continuation, so acceptance collapses) instead of forcing the replayed accept lengths")
    p.add_argument("--prompts", help="JSONL prompts (seeded split: calibration / evaluation halves); default: "
                                     "random token prompts")
    p.add_argument("--tokenizer", help="tokenizer directory for --prompts")
    p.add_argument("--calibration", help="a calibration artifact (default: calibrate here, on other prompts and seed)")
    p.add_argument("--out", default="bench_out", help="directory for bench.json and the plots")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--num-prompts", type=positive_int, default=None, help="evaluation prompts (default: 3 with "
                                                                          "--tiny, else 4)")
    p.add_argument("--prompt-tokens", type=positive_int, default=None,
                   help="length of the random prompts (default: 32 with --tiny, else 512)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: 64 with --tiny, else 256")
    p.add_argument("--calibration-tokens", type=positive_int, default=None,
                   help="new tokens per calibration prompt (default: 32 with --tiny, else 64)")
    p.add_argument("--repeats", type=repeats_count, default=3,
                   help="timed passes over the prompts per row, interleaved across rows; tokens/s is their median "
                        "and a row whose spread is large is flagged noisy (at least 2)")
    p.add_argument("--skip-transformers", action="store_true", help="leave out transformers' static AR (~90 s compile)")
    p.add_argument("--methods", default=None,
                   help="the speculative rows to run, comma-separated, of vanilla, static, nominal, hybridspec, dcut, "
                        "evict, target-acceptance (default: all; AR (ours) always runs, and a run of fixed-length rows "
                        "alone skips the calibration); the others are listed as left out in bench.json")
    p.add_argument("--batch-size", type=int, default=1, choices=[1, 2, 4],
                   help="rows per decoded batch: AR (ours, batched), vanilla DFlash, static and HybridSpec on "
                        "batches of that size, tokens/s the total over the batch; --num-prompts counts batches, and "
                        "the calibration run here also measures this size")
    p.add_argument("--seed", type=int, default=0, help="evaluation draws; calibration uses seed + 1")
    p.add_argument("--cpu-threads", type=positive_int, default=1, help=CPU_THREADS_HELP)
    p.add_argument("--out-split-k", type=int, default=None, choices=range(1, 17), metavar="{1..16}",
                   help="run the output projections (the target's mixers, the drafter's o_proj and down_proj) as "
                        "this many split-K partial sums (hybridspec.ops.linear.KERNEL_CONFIG.out_split_k; default: "
                        "the library's, 1: their modules); recorded in bench.json")
    p.add_argument("--router-split-k", type=int, default=None, choices=range(1, 17), metavar="{1..16}",
                   help="run each MoE block's router GEMM as this many split-K partial sums, added by the routing "
                        "kernel (hybridspec.ops.linear.KERNEL_CONFIG.router_split_k; default: the library's, 1: one "
                        "GEMM); recorded in bench.json")
    p.add_argument("--in-split-k", type=int, default=None, choices=range(1, 17), metavar="{1..16}",
                   help="run the target mixers' fused input projections as this many split-K partial sums "
                        "(hybridspec.ops.linear.KERNEL_CONFIG.in_split_k; default: the library's, 1: cuBLAS); "
                        "recorded in bench.json")


@dataclass(frozen=True)
class Command:
    help: str
    description: str
    # adds the subcommand's arguments; imports nothing heavy
    arguments: Callable[[argparse.ArgumentParser], None]
    # "module:function", called with the parsed arguments; returns an exit status or None
    run: str


COMMANDS: dict[str, Command] = {
    "calibrate": Command(
        help="fit the length policy of a target + drafter pair on this machine",
        description="Fit the acceptance model, cost curve, routing-correction tables and rho of the HybridSpec "
                    "length policy, and write them as a JSON artifact for generate(..., calibration=path). Uses "
                    "the calibration half of the prompts (seeded split). Tiny models on 2 CPU cores: ~30 s with "
                    "the defaults.",
        arguments=_calibrate_arguments,
        run="hybridspec.calibration.run:main",
    ),
    "bench": Command(
        help="the end-to-end table: AR, transformers' static AR, vanilla DFlash and every length policy",
        description="Decode the same prompts with every method side by side and print the table (also JSON and PNG "
                    "plots under --out). With a replay drafter (default for --shape and --tiny) acceptance is "
                    "simulated and labelled so. Every row is timed --repeats times; rows whose spread (or whose "
                    "calibration's cost fit) makes the ratio meaningless are flagged. --tiny on 2 CPU cores: "
                    "~1 minute with the defaults.",
        arguments=_bench_arguments,
        run="hybridspec.bench:main",
    ),
    "train-drafter": Command(
        help=training_cli.HELP,
        description=training_cli.DESCRIPTION,
        arguments=training_cli.add_arguments,
        run="hybridspec.training.cli:run",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridspec", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, command in COMMANDS.items():
        command.arguments(sub.add_parser(name, help=command.help, description=command.description,
                                         formatter_class=HelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, function = COMMANDS[args.command].run.split(":")
    status = getattr(importlib.import_module(module), function)(args)
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
