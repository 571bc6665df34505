"""The reference loop: the round of `hybridspec.round` run eagerly from the host, verifying exactly
w rows, for the calls the runner cannot serve: processors that read the sequence, stop strings and
custom stopping criteria, `output_scores` / `output_logits`, calibration's recorder, host drafters.

Per round the host reads w (to verify exactly w rows) and then A and the empty position (to emit);
every position is processed with the sequence target-only decoding would hold there, and stopping
is checked token by token, as target-only decoding does.
"""

from __future__ import annotations

import time

import torch

from hybridspec.generation.options import HybridSpecOptions
from hybridspec.patches.forward import empty_state
from hybridspec.round.accept import process_positions
from hybridspec.round.emit import emit
from hybridspec.round.prefill import start
from hybridspec.round.round import Round, Sampler
from hybridspec.round.stats import HybridSpecStats
from hybridspec.round.target import Target
from hybridspec.state import MAX_VERIFY


def reference_decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                     opts: HybridSpecOptions):
    """Returns `(sequences, scores or None, logits or None, stats)`."""
    drafter, streamer, recorder = opts.drafter, opts.streamer, opts.recorder
    want_scores, want_logits = generation_config.output_scores, generation_config.output_logits
    scores, raw_logits = [], []
    max_len = generation_config.max_length
    target = Target(model, tuple(drafter.target_layer_ids))
    # a round writes up to MAX_VERIFY rows past the committed length
    state = empty_state(target.family, model, input_ids.shape[0], max_len + MAX_VERIFY, target.device)
    sampler = Sampler(bool(generation_config.do_sample), rule=opts.accept)
    seq = input_ids

    def process(logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        # position i sees the sequence target-only decoding would hold there
        return process_positions(logits_processor, seq, drafts, logits)

    def take_from(tokens, processed, logits):
        def take(i: int, token: int) -> bool:
            nonlocal seq
            if want_scores:
                scores.append(processed[:, i])
            if want_logits:
                raw_logits.append(logits[:, i])
            seq = torch.cat([seq, tokens[:, i : i + 1]], dim=-1)
            if streamer is not None:
                streamer.put(tokens[:, i : i + 1].cpu())
            return bool(stopping_criteria(seq, processed[:, i]).all())

        return take

    first, processed, logits = start(target, state, drafter, input_ids, process, sampler, max_len)
    done = take_from(first, processed[:, None], logits[:, None])(0, int(first[0, 0]))
    rnd = Round(target, state, drafter, opts.policy, sampler, exact=True, record_routing=recorder is not None)
    stats = HybridSpecStats()
    started = _now(seq.device)
    while not done:
        if recorder is not None:
            recorder.begin()
        budget = torch.full((seq.shape[0],), max_len - seq.shape[1], dtype=torch.long, device=seq.device)
        r = rnd(seq, budget, process)
        # the round's one read after verifying: its lengths and the emitted tokens, together
        m, empty, w, w0, layer0, *tokens = torch.cat(
            [torch.stack([r.accepted[0] + 1, r.empty[0], r.w[0], r.w0[0], r.layer0[0]]), r.tokens[0]]).tolist()
        kept, done = emit(tokens[:m], empty, take_from(r.tokens, r.processed, r.logits))
        stats.record(w, w0, kept, layer0)
        if recorder is not None:
            recorder.end(r.block, w, kept, r.routing, done)
    stats.decode_seconds = _now(seq.device) - started
    return seq, tuple(scores) if want_scores else None, tuple(raw_logits) if want_logits else None, stats


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
