"""The decoding method `generate(..., hybridspec=True)` hands to transformers as `custom_generate`:
the CUDA-graph runner where it can serve the call, else the reference loop. Both run the round of
`hybridspec.round` (draft, select, Stage 0, correct, verify, accept, commit)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hybridspec.generation.options import HybridSpecOptions
from hybridspec.generation.reference import assemble, reference_decode
from hybridspec.policy import graph_batch_size
from hybridspec.round.stats import HybridSpecStats
from hybridspec.round.stopping import HostStopping
from hybridspec.runner.decode import cached_runner, runner_blocker, warn_fallback


@dataclass
class HybridSpecOutput(GenerateDecoderOnlyOutput):
    hybridspec_stats: HybridSpecStats | None = None


def hybridspec_decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                      synced_gpus=False, hybridspec_options: HybridSpecOptions | None = None, **model_kwargs):
    """Speculative decoding: token for token equal to `generate(do_sample=False)` when greedy, and
    with the output distribution of target-only `generate(do_sample=True)` when sampling. A batch
    (1..4 rows, left-padded) decodes every row on its own and pads rows that stopped, as
    transformers' batched `generate` does."""
    opts = hybridspec_options
    mask, positions = _padding(model_kwargs)
    blocker = runner_blocker(opts, logits_processor, stopping_criteria, generation_config)
    if blocker is None:
        return _decode_on_runner(model, input_ids, logits_processor, stopping_criteria, generation_config, opts, mask,
                                 positions)
    if not opts.reference_loop:
        warn_fallback(model, blocker)
    seq, scores, logits, stats = reference_decode(model, input_ids, logits_processor, stopping_criteria,
                                                  generation_config, opts, mask, positions)
    if opts.streamer is not None:
        opts.streamer.end()
    if not generation_config.return_dict_in_generate:
        return seq
    return HybridSpecOutput(sequences=seq, scores=scores, logits=logits, hybridspec_stats=stats)


def _padding(model_kwargs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The `attention_mask` and `position_ids` transformers prepared, where the batch is padded;
    (None, None) without padding, whose prefill then runs exactly as it did before batching."""
    mask = model_kwargs.get("attention_mask")
    if mask is None or bool(mask.all()):
        return None, None
    return mask, model_kwargs.get("position_ids")


def _decode_on_runner(model, input_ids, logits_processor, stopping_criteria, generation_config, opts, mask,
                      positions):
    """The same call on the fixed-shape runner (CUDA graphs on CUDA unless `enforce_eager`)."""
    B = input_ids.shape[0]
    # graphs exist per batch size 1, 2, 4: a batch of 3 runs as 4 with a copy of row 0, dropped after
    size = graph_batch_size(B)
    ids = _extend_rows(input_ids, size, 0)
    mask = None if mask is None else _extend_rows(mask, size, 0)
    positions = None if positions is None else _extend_rows(positions, size, positions.dim() - 2)
    runner = cached_runner(model, opts.drafter, opts.policy, logits_processor, generation_config, opts.enforce_eager,
                           opts.accept, batch_size=size)
    streamer = opts.streamer
    P = input_ids.shape[1]
    first_tokens, prefill_seconds = runner.start_timed(ids, logits_processor, mask, positions)
    stop = HostStopping.from_criteria(stopping_criteria, generation_config.max_length)
    put = None if streamer is None else (lambda tokens: streamer.put(torch.tensor([tokens])))
    if put is not None:
        put(first_tokens[:1])
    rows, stats = runner.decode_batch(P, first_tokens, stop, put, live=B)
    stats.prefill_seconds = prefill_seconds
    if streamer is not None:
        streamer.end()
    rows = [torch.cat([input_ids[b:b + 1], torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)],
                      dim=-1) for b, tokens in enumerate(rows[:B])]
    seq = assemble(rows, generation_config)
    if not generation_config.return_dict_in_generate:
        return seq
    return HybridSpecOutput(sequences=seq, hybridspec_stats=stats)


def _extend_rows(x: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """`x` with copies of its row 0 along `dim` appended up to `size` rows."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    return torch.cat([x, x.narrow(dim, 0, 1).expand(*(extra if d == dim else -1 for d in range(x.dim())))], dim=dim)
