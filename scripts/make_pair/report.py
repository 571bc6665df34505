"""Measure the committed pair on the CPU in fp32 (the figures of docs/pair.md).

    PYTHONPATH=. python scripts/make_pair/report.py --pair assets/pair --prompts 16 --out pair_report.json

Acceptance: mean acceptance length (tokens per verification round) of real speculative runs
through `generate(..., hybridspec=True)`, 64 new tokens per held-out prompt, greedy and temperature
1, default policy and `verify_length=16`. U(w): the mean number of distinct experts the tokens
`s..s+w-1` of the target's greedy continuations route to (every start s), at Layer 0 and averaged
over the layers, for the trained router, for the same architecture at its seeded initialisation
(the router before training) and for uniform random top-2 routing (64 (1 - (62/64)^w)).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

WINDOW = 16


def distinct_curve(model, sequences: list[torch.Tensor], starts: list[int]) -> dict:
    """U(w), w = 1..16, at Layer 0 and averaged over the MoE layers, over every window that
    starts at or after `starts[i]` and fits in sequence i."""
    layer0 = torch.zeros(WINDOW, dtype=torch.float64)
    every = torch.zeros(WINDOW, dtype=torch.float64)
    count = 0
    top_k = model.config.num_experts_per_tok
    for seq, start in zip(sequences, starts):
        with torch.no_grad():
            out = model(seq, output_router_logits=True, use_cache=False)
        chosen = [logits.topk(top_k, dim=-1).indices for logits in out.router_logits]  # [T, k] per layer
        for s in range(start, seq.shape[1] - WINDOW + 1):
            count += 1
            for w in range(1, WINDOW + 1):
                sizes = [len(set(c[s : s + w].flatten().tolist())) for c in chosen]
                layer0[w - 1] += sizes[0]
                every[w - 1] += sum(sizes) / len(sizes)
    return {"layer0": (layer0 / count).tolist(), "all_layers": (every / count).tolist(), "windows": count}


def main(argv=None):
    import warnings

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5MoeForCausalLM

    import hybridspec
    from hybridspec.training.acceptance import acceptance_report

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pair", default="assets/pair")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts (of the 64 committed)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling runs; also the initial router")
    p.add_argument("--out", default=None, help="JSON file for the figures (default: print only)")
    args = p.parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore", UserWarning)
    pair = Path(args.pair)
    began = time.perf_counter()
    target = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    drafter = hybridspec.DFlashDrafter.from_pretrained(pair / "drafter", dtype=torch.float32)
    rows = [json.loads(line) for line in (pair / "heldout_prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [torch.tensor([tokenizer(r["prompt"])["input_ids"]]) for r in rows[: args.prompts]]

    report = {"simulated": False, "acceptance_kind": "real: speculative runs of the committed pair",
              "prompts": len(prompts), "new_tokens": args.new_tokens, "dtype": "float32", "device": "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__}
    report["acceptance"] = acceptance_report(hybridspec.enable(target), drafter, prompts, args.new_tokens, args.seed,
                                             enforce_eager=False)
    continuations = [target.generate(q, max_new_tokens=args.new_tokens, do_sample=False) for q in prompts]
    report["sample"] = {"prompt": rows[0]["prompt"],
                        "continuation": tokenizer.decode(continuations[0][0, prompts[0].shape[1]:])}
    starts = [q.shape[1] for q in prompts]
    report["distinct_experts"] = {"trained": distinct_curve(target, continuations, starts)}
    torch.manual_seed(args.seed)
    initial = Qwen3_5MoeForCausalLM(target.config).eval()
    report["distinct_experts"]["initial"] = distinct_curve(initial, continuations, starts)
    n, k = target.config.num_experts, target.config.num_experts_per_tok
    report["distinct_experts"]["uniform"] = [n * (1 - (1 - k / n) ** w) for w in range(1, WINDOW + 1)]
    report["seconds"] = round(time.perf_counter() - began, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
