"""Quickstart: speculative decoding with hybridspec on a CPU, nothing downloaded.

    python examples/quickstart.py        # ~15 s on 2 CPU cores

What it shows holds on any hardware: how many tokens each target forward pass yields (the saving a
GPU turns into speed) and that the output is exactly the target's own. It does not time anything:
on a CPU, models this small are overhead-bound, so tokens/s would only measure Python.

The pair it runs comes from `default_pair()`: the trained reference pair of `assets/pair` (a
7.6M-parameter Qwen3.5-MoE target trained on Python sources and its DFlash drafter; real text, real
acceptance; docs/pair.md). `tiny_random_pair()` is the embedded random pair: its drafter guesses
almost nothing right, so with it the passes saved are shown again with the replay drafter, whose
acceptance is simulated and labelled so.
"""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybridspec
from hybridspec.sim.replay import ReplayDrafter

NEW_TOKENS = 64
GPU_NOTE = (
    "Wall-clock speedups need a GPU: on a CPU, tiny models are overhead-bound (a round's drafting and "
    "Python cost more than the target's arithmetic), so tokens/s here says nothing about speed. On a GPU a "
    "pass over 16 tokens costs about what a pass over 1 does, and the passes saved become speed; measure it "
    "there with `hybridspec bench --target DIR --drafter DIR --prompts examples/prompts.jsonl` (or "
    "`hybridspec bench --shape qwen3.6-35b-a3b` for random full-size weights, simulated acceptance)."
)


PAIR = Path(__file__).resolve().parents[1] / "assets" / "pair"


def default_pair():
    """(target, drafter, prompts, tokenizer or None) the quickstart runs. Prompts are text when a
    tokenizer is given, else token ids `[1, n]`. The reference pair of `assets/pair`
    (docs/pair.md): a 7.6M-parameter Qwen3.5-MoE trained on Python sources and a DFlash drafter
    trained for it with `hybridspec train-drafter`; the first two of its held-out prompts."""
    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    drafter = hybridspec.DFlashDrafter.from_pretrained(PAIR / "drafter", dtype=torch.float32)
    rows = [json.loads(line) for line in (PAIR / "heldout_prompts.jsonl").read_text().splitlines()[:2]]
    return target, drafter, [r["prompt"] for r in rows], tokenizer


def tiny_random_pair():
    """The seeded tiny random pair of `hybridspec.tiny` (every code path, no language)."""
    tiny = hybridspec.tiny
    return tiny.tiny_target(seed=0), tiny.tiny_drafter(seed=0), [torch.tensor([[1, 17, 33, 64, 5, 90, 12, 7]])], None


def encode(prompt, tokenizer) -> torch.Tensor:
    return tokenizer(prompt, return_tensors="pt").input_ids if tokenizer is not None else prompt


def show(tokens: torch.Tensor, tokenizer) -> str:
    if tokenizer is not None:
        return repr(tokenizer.decode(tokens))
    return f"token ids {tokens[:16].tolist()}{' ...' if len(tokens) > 16 else ''}"


def report(name: str, out, reference: torch.Tensor, prompt_len: int) -> None:
    stats = out.hybridspec_stats
    new = out.sequences.shape[1] - prompt_len
    # the prefill yields the first token; every round is one more target pass
    passes = 1 + stats.rounds
    print(f"{name}:")
    print(f"  {new} tokens in {passes} target passes instead of {new} (1 prefill + {stats.rounds} verification "
          f"rounds; mean acceptance length {stats.mean_acceptance_length:.2f} tokens per round, "
          f"mean verified length {sum(stats.verify_lengths) / max(1, stats.rounds):.1f})")
    print(f"  identical to target-only greedy decoding: {torch.equal(out.sequences, reference)}")


def sample(model, prompt, seed, **kwargs):
    torch.manual_seed(seed)
    out = model.generate(prompt, max_new_tokens=24, do_sample=True, temperature=0.7, top_p=0.9, **kwargs)
    return out[0, prompt.shape[1]:]


def main():
    # small models on a CPU: one thread is faster (no op is big enough to split) and steadier on a busy machine
    torch.set_num_threads(1)
    target, drafter, prompts, tokenizer = default_pair()
    hybridspec.enable(target)
    for text in prompts:
        prompt = encode(text, tokenizer)
        P = prompt.shape[1]
        # without hybridspec=True, generate is transformers' own: the reference
        reference = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        print(f"prompt: {show(prompt[0], tokenizer)}")
        print(f"target-only greedy: {show(reference[0, P:], tokenizer)}")

        out = target.generate(prompt, assistant_model=drafter, hybridspec=True, max_new_tokens=NEW_TOKENS,
                              do_sample=False, return_dict_in_generate=True)
        trained = "" if tokenizer is not None else " (random weights: it rarely guesses right)"
        report(f"hybridspec + DFlash drafter{trained}", out, reference, P)

        if tokenizer is None:
            replay = ReplayDrafter(drafter, reference[0, P:], seed=1)
            out = target.generate(prompt, assistant_model=replay, hybridspec=True, verify_length=16,
                                  max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
            report("hybridspec + replay drafter, SIMULATED acceptance (w = 16)", out, reference, P)

        first = sample(target, prompt, seed=0, assistant_model=drafter, hybridspec=True)
        again = sample(target, prompt, seed=0, assistant_model=drafter, hybridspec=True)
        print(f"sampled (temperature 0.7, top_p 0.9): {show(first, tokenizer)}")
        print(f"  same seed, same tokens: {torch.equal(first, again)}; target-only sampling with that seed draws "
              "other tokens from the same distribution (the point-mass rule)")
    print(GPU_NOTE)


if __name__ == "__main__":
    main()
