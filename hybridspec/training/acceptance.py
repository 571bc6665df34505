"""The held-out acceptance report: mean acceptance length from actual speculative runs through
`model.generate(..., assistant_model=drafter, hybridspec=True)`, not token accuracy (the two are
known to disagree)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

# (name, generate arguments): greedy and temperature-1 sampling, the default adaptive policy and
# vanilla DFlash's fixed verification of the whole block
SETTINGS = (
    ("greedy", {"do_sample": False}),
    ("greedy, verify_length=16", {"do_sample": False, "verify_length": 16}),
    ("temperature 1", {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}),
    ("temperature 1, verify_length=16", {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                         "verify_length": 16}),
)


def _settings(block_size: int):
    for name, kwargs in SETTINGS:
        if kwargs.get("verify_length", 0) > block_size:
            kwargs = dict(kwargs, verify_length=block_size)
            name = name.replace("16", str(block_size))
        yield name, kwargs


@torch.no_grad()
def acceptance_report(model, drafter, prompts: list[torch.Tensor], new_tokens: int, seed: int = 0,
                      enforce_eager: bool = True) -> dict:
    """For each setting: the mean over prompts (those with at least one round) of each prompt's
    mean acceptance length (tokens emitted per verification round, A + 1), its min and max,
    rounds, the pooled length (all tokens emitted in rounds / all rounds: prompts with many short
    rounds weigh more, as they do in throughput), and for greedy settings how
    many outputs equal target-only greedy. `model` must be `hybridspec.enable`d; `prompts` are
    `[1, P]` id tensors. `enforce_eager` keeps CUDA runs free of graph capture and compilation
    (this measures acceptance, not speed)."""
    device = next(model.parameters()).device
    reference = [model.generate(p.to(device), max_new_tokens=new_tokens, do_sample=False) for p in prompts]
    report = {}
    for name, kwargs in _settings(drafter.block_size):
        lengths, rounds, emitted, identical = [], 0, 0, 0
        for i, (prompt, ref) in enumerate(tqdm(list(zip(prompts, reference)), desc=f"acceptance ({name})")):
            torch.manual_seed(seed + i)
            out = model.generate(prompt.to(device), max_new_tokens=new_tokens, return_dict_in_generate=True,
                                 assistant_model=drafter, hybridspec=True, enforce_eager=enforce_eager, **kwargs)
            stats = out.hybridspec_stats
            # a prompt whose first token already stops generation has no rounds to average
            if stats.rounds:
                lengths.append(stats.mean_acceptance_length)
            rounds += stats.rounds
            emitted += sum(a + 1 for a in stats.accepted)
            identical += int(torch.equal(out.sequences, ref))
        row = {"mean_acceptance_length": sum(lengths) / max(1, len(lengths)), "min": min(lengths, default=0.0),
               "max": max(lengths, default=0.0), "pooled_acceptance_length": emitted / max(1, rounds),
               "rounds": rounds, "prompts": len(prompts),
               "prompts_with_rounds": len(lengths), "per_prompt": [round(x, 3) for x in lengths]}
        if not kwargs["do_sample"]:
            row["identical_to_target_greedy"] = identical
        report[name] = row
    return report
