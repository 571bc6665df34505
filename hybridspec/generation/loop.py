"""The decoding method `generate(..., hybridspec=True)` hands to transformers as `custom_generate`:
the CUDA-graph runner where it can serve the call, else the reference loop. Both run the round of
`hybridspec.round` (draft, select, Stage 0, correct, verify, accept, commit)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hybridspec.generation.options import HybridSpecOptions
from hybridspec.generation.reference import reference_decode
from hybridspec.round.stats import HybridSpecStats
from hybridspec.round.stopping import HostStopping
from hybridspec.runner.decode import cached_runner, runner_blocker, warn_fallback


@dataclass
class HybridSpecOutput(GenerateDecoderOnlyOutput):
    hybridspec_stats: HybridSpecStats | None = None


def hybridspec_decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                      synced_gpus=False, hybridspec_options: HybridSpecOptions | None = None, **model_kwargs):
    """Speculative decoding: token for token equal to `generate(do_sample=False)` when greedy, and
    with the output distribution of target-only `generate(do_sample=True)` when sampling."""
    opts = hybridspec_options
    blocker = runner_blocker(opts, logits_processor, stopping_criteria, generation_config)
    if blocker is None:
        return _decode_on_runner(model, input_ids, logits_processor, stopping_criteria, generation_config, opts)
    if not opts.reference_loop:
        warn_fallback(model, blocker)
    seq, scores, logits, stats = reference_decode(model, input_ids, logits_processor, stopping_criteria,
                                                  generation_config, opts)
    if opts.streamer is not None:
        opts.streamer.end()
    if not generation_config.return_dict_in_generate:
        return seq
    return HybridSpecOutput(sequences=seq, scores=scores, logits=logits, hybridspec_stats=stats)


def _decode_on_runner(model, input_ids, logits_processor, stopping_criteria, generation_config, opts):
    """The same call on the fixed-shape runner (CUDA graphs on CUDA unless `enforce_eager`)."""
    runner = cached_runner(model, opts.drafter, opts.policy, logits_processor, generation_config, opts.enforce_eager,
                           opts.accept)
    streamer = opts.streamer
    P = input_ids.shape[1]
    first, _ = runner.start(input_ids, logits_processor)
    stop = HostStopping.from_criteria(stopping_criteria, generation_config.max_length)
    put = None if streamer is None else (lambda tokens: streamer.put(torch.tensor([tokens])))
    if put is not None:
        put([int(first)])
    tokens, stats = runner.decode(P, int(first), stop, put)
    if streamer is not None:
        streamer.end()
    seq = torch.cat([input_ids, torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)], dim=-1)
    if not generation_config.return_dict_in_generate:
        return seq
    return HybridSpecOutput(sequences=seq, hybridspec_stats=stats)
