"""Quickstart on the embedded default: a seeded tiny Qwen3.5-MoE target and DFlash drafter.

    python examples/quickstart.py

Generates with and without HybridSpec and checks that the tokens are identical. The models are
random, so a DFlash drafter's guesses are rarely right; the second run replays the target's own
continuation with the fixed acceptance model of the replay drafter (simulated acceptance) to show
what multi-token rounds look like. The last part samples: HybridSpec keeps the distribution of
target-only sampling (not its tokens for a given seed), and `torch.manual_seed` reproduces a run.
"""

import time

import torch
import transformers

import hybridspec
from hybridspec.sim.replay import ReplayDrafter
from hybridspec.tiny import tiny_drafter, tiny_target


def timed_generate(model, prompt, **kwargs):
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=64, do_sample=False, return_dict_in_generate=True, **kwargs)
    seconds = time.perf_counter() - start
    return out, (out.sequences.shape[1] - prompt.shape[1]) / seconds


def report(name, out, tokens_per_s, reference):
    stats = out.hybridspec_stats
    print(f"{name}: {tokens_per_s:.1f} tokens/s, {stats.rounds} rounds, "
          f"mean acceptance length {stats.mean_acceptance_length:.2f}")
    print(f"identical to target-only greedy: {torch.equal(out.sequences, reference.sequences)}")


def sample(model, prompt, seed, **kwargs):
    torch.manual_seed(seed)
    out = model.generate(prompt, max_new_tokens=24, do_sample=True, temperature=0.7, top_p=0.9,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences[0, prompt.shape[1]:]


def main():
    # transformers notes once per kernel that it uses its pure-torch GDN path on this machine
    transformers.logging.set_verbosity_error()
    target = tiny_target(seed=0)
    drafter = tiny_drafter(seed=0)
    prompt = torch.tensor([[1, 17, 33, 64, 5, 90, 12, 7]])

    reference, ar_tps = timed_generate(target, prompt)
    print(f"target only: {ar_tps:.1f} tokens/s")

    hybridspec.enable(target)
    out, tps = timed_generate(target, prompt, assistant_model=drafter, hybridspec=True)
    report("hybridspec + DFlash drafter (random weights)", out, tps, reference)
    replay = ReplayDrafter(drafter, reference.sequences[0, prompt.shape[1]:], seed=1)
    out, tps = timed_generate(target, prompt, assistant_model=replay, hybridspec=True, verify_length=16)
    report("hybridspec + replay drafter (simulated acceptance, w = 16)", out, tps, reference)

    first = sample(target, prompt, seed=0, assistant_model=drafter, hybridspec=True)
    again = sample(target, prompt, seed=0, assistant_model=drafter, hybridspec=True)
    print(f"sampled with hybridspec (temperature 0.7, top_p 0.9): {first.tolist()}")
    print(f"same seed, same tokens: {torch.equal(first, again)}")
    # the point-mass rule draws every token from the target's own distribution; the draws differ
    print(f"target-only sampling, same seed: {sample(target, prompt, seed=0).tolist()} "
          "(other tokens, the same distribution)")


if __name__ == "__main__":
    main()
