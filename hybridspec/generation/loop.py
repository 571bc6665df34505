"""The decoding method `generate(..., hybridspec=True)` hands to transformers as `custom_generate`.

Stages per round: draft, select (the verification length w), verify (one target pass over
`[anchor, d_1 .. d_{w-1}]`), accept (every position processed by the same logits processors and
warpers as target-only decoding, then the greedy or point-mass sampling rule of
`hybridspec.generation.accept`), commit (m = A + 1 tokens into every layer and the drafter).
Stopping is checked token by token, as target-only decoding does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hybridspec.generation.accept import EMPTY_MESSAGE, greedy_accept, process_positions, read_accepted, sample_accept
from hybridspec.generation.options import HybridSpecOptions
from hybridspec.generation.prefill import prefill
from hybridspec.generation.stats import HybridSpecStats
from hybridspec.generation.verify import Verifier
from hybridspec.patches import family_of
from hybridspec.patches.forward import allocate_state
from hybridspec.runner.decode import cached_runner, runner_blocker, warn_fallback
from hybridspec.runner.stopping import HostStopping


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
    drafter, streamer = opts.drafter, opts.streamer
    family = family_of(model)
    # the drafter reads its taps concatenated in its own order
    taps = tuple(drafter.target_layer_ids)
    want_scores, want_logits = generation_config.output_scores, generation_config.output_logits
    scores, raw_logits = [], []
    stats = HybridSpecStats()
    seq = input_ids
    max_len = generation_config.max_length
    accept = sample_accept if generation_config.do_sample else greedy_accept

    def emit(token: torch.Tensor, processed: torch.Tensor, raw: torch.Tensor) -> bool:
        """Append one chosen token `[B, 1]` whose position scored `processed` / `raw` `[B, V]`; True to stop."""
        nonlocal seq
        if want_scores:
            scores.append(processed)
        if want_logits:
            raw_logits.append(raw)
        seq = torch.cat([seq, token], dim=-1)
        if streamer is not None:
            streamer.put(token.cpu())
        return bool(stopping_criteria(seq, processed).all())

    logits, cache, feats = prefill(model, input_ids, taps)
    state = allocate_state(family, model, cache, max_len + 16)
    del cache
    recorder = opts.recorder
    verify = Verifier(family, model, state, opts.policy, taps, record_routing=recorder is not None)
    drafter.start(input_ids, feats)
    # the prefill's last position is a round of one position with no drafts: its token is the bonus
    no_draft = input_ids[:, :0]
    processed = process_positions(logits_processor, seq, no_draft, logits[:, None])
    tokens, accepted = accept(processed, no_draft)
    if read_accepted(accepted, processed, generation_config.do_sample)[1] == 0:
        raise RuntimeError(EMPTY_MESSAGE)
    anchor = tokens[:, :1]
    done = emit(anchor, processed[:, 0], logits)
    lm_head = model.get_output_embeddings()
    started = _now(seq.device)
    while not done:
        remaining = max_len - seq.shape[1]
        if recorder is not None:
            recorder.begin()
        block = drafter.propose(seq)
        verified = verify(anchor, block, remaining)
        logits = lm_head(verified.hidden).float()  # [B, w, V]
        processed = process_positions(logits_processor, seq, verified.draft, logits)  # [B, w, V]
        tokens, accepted = (opts.accept or accept)(processed, verified.draft, None)
        # emitting appends to the host-side sequence one token at a time, so it reads A here
        kept, empty = read_accepted(accepted, processed, generation_config.do_sample)
        for i in range(kept + 1):
            if i == empty:
                raise RuntimeError(EMPTY_MESSAGE)
            if emit(tokens[:, i : i + 1], processed[:, i], logits[:, i]):
                # a stop inside the block ends generation there, as it would end target-only decoding
                done, kept = True, i
                break
        stats.verify_lengths.append(verified.w)
        stats.nominal_lengths.append(verified.w0)
        stats.accepted.append(kept)
        anchor = tokens[:, kept : kept + 1]
        if not done:
            state.commit(kept + 1)
            drafter.observe(verified.features, kept + 1)
        if recorder is not None:
            recorder.end(block, verified.w, kept, verified.routing, done)
    stats.decode_seconds = _now(seq.device) - started
    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return seq
    return HybridSpecOutput(
        sequences=seq,
        scores=tuple(scores) if want_scores else None,
        logits=tuple(raw_logits) if want_logits else None,
        hybridspec_stats=stats,
    )


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


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
