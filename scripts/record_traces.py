"""Record an acceptance trace from a real target + drafter pair, for `hybridspec bench --traces`.

    python scripts/record_traces.py --target assets/pair/target --drafter assets/pair/drafter \\
        --prompts assets/pair/heldout_prompts.jsonl --out traces.json

Greedy speculative decoding of every prompt, all 16 drafts verified each round; each full round's
drafter confidence and entropy per position and its accepted drafts (`hybridspec.sim.traces`).
"""

from __future__ import annotations

import argparse

import torch

import hybridspec
from hybridspec.calibration.prompts import load_prompts, load_tokenizer, render
from hybridspec.loading import load_drafter, load_target
from hybridspec.sim.traces import record_trace


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="local target model directory")
    p.add_argument("--drafter", required=True, help="local DFlash drafter directory")
    p.add_argument("--prompts", required=True, help="JSONL prompts")
    p.add_argument("--out", required=True, help="where to write the trace (JSON)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = hybridspec.enable(load_target(args.target, args.device, torch.float32))
    drafter = load_drafter(args.drafter, args.device, torch.float32)
    drafter.bind(model)
    tok = load_tokenizer(None, args.target, model.config.get_text_config().vocab_size)
    prompts = [render(row, tok).to(args.device) for row in load_prompts(args.prompts)[: args.num_prompts]]
    trace = record_trace(model, drafter, prompts, args.max_new_tokens, source=f"{args.target} + {args.drafter}")
    trace.save(args.out)
    accepted = trace.accepted.float()
    print(f"{len(accepted)} full rounds; mean accepted drafts {accepted.mean():.2f} "
          f"(acceptance length {accepted.mean() + 1:.2f} at w = {drafter.block_size}); wrote {args.out}")


if __name__ == "__main__":
    main()
