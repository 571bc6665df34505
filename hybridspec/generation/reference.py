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
from hybridspec.round.stats import HybridSpecStats, device_time
from hybridspec.round.target import Target
from hybridspec.state import MAX_VERIFY


def reference_decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                     opts: HybridSpecOptions, attention_mask=None, position_ids=None):
    """Returns `(sequences, scores or None, logits or None, stats)`. A batch (left-padded with
    `attention_mask`) keeps one host sequence per row: each row emits and stops on its own, and
    the output pads a finished row after its stop, as transformers does."""
    drafter, streamer, recorder = opts.drafter, opts.streamer, opts.recorder
    want_scores, want_logits = generation_config.output_scores, generation_config.output_logits
    scores, raw_logits = [], []
    max_len = generation_config.max_length
    B = input_ids.shape[0]
    target = Target(model, tuple(drafter.target_layer_ids))
    # a round writes up to MAX_VERIFY rows past the committed length
    state = empty_state(target.family, model, B, max_len + MAX_VERIFY, target.device)
    sampler = Sampler(bool(generation_config.do_sample), rule=opts.accept)
    # each row's host sequence: its (padded) prompt and what it emitted
    rows = list(input_ids.split(1))
    done = [False] * B

    def process(logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        # position i of row b sees the sequence target-only decoding would hold there
        return torch.cat([process_positions(logits_processor, rows[b], drafts[b:b + 1], logits[b:b + 1])
                          for b in range(B)])

    def take_from(b, tokens, processed, logits):
        def take(i: int, token: int) -> bool:
            if want_scores:
                scores.append(processed[:, i])
            if want_logits:
                raw_logits.append(logits[:, i])
            rows[b] = torch.cat([rows[b], tokens[b:b + 1, i : i + 1]], dim=-1)
            if streamer is not None:
                streamer.put(tokens[b:b + 1, i : i + 1].cpu())
            return bool(stopping_criteria(rows[b], processed[b:b + 1, i]).all())

        return take

    prefill_started = device_time(input_ids.device)
    first, processed, logits = start(target, state, drafter, input_ids, process, sampler, max_len, attention_mask,
                                     position_ids)
    first_tokens = first[:, 0].tolist()
    stats = HybridSpecStats(prefill_seconds=time.perf_counter() - prefill_started)
    for b, token in enumerate(first_tokens):
        done[b] = take_from(b, first, processed[:, None], logits[:, None])(0, token)
    rnd = Round(target, state, drafter, opts.policy, sampler, exact=True, record_routing=recorder is not None)
    started = last = device_time(input_ids.device)
    while not all(done):
        if recorder is not None:
            recorder.begin()
        left = [0 if done[b] else max_len - rows[b].shape[1] for b in range(B)]
        budget = torch.tensor(left, dtype=torch.long, device=input_ids.device)
        # a host drafter reads the whole sequence (batch one); a device drafter only the anchors
        context = rows[0] if B == 1 else torch.cat([r[:, -1:] for r in rows])
        r = rnd(context, budget, process)
        # the round's one read after verifying: every row's lengths and emitted tokens, together
        table = torch.cat([torch.stack([r.accepted + 1, r.empty, r.w, r.w0, r.layer0], dim=-1), r.tokens], dim=-1)
        kept_rows, listed = [], table.tolist()
        for b, (m, empty, w, w0, layer0, *tokens) in enumerate(listed):
            if done[b]:
                continue
            kept, done[b] = emit(tokens[:m], empty, take_from(b, r.tokens, r.processed, r.logits))
            kept_rows.append(kept)
        # the round's lengths are the batch's (row 0's entries)
        w, w0, layer0 = listed[0][2:5]
        # the table's read waited for the round; full: every row verified all w tokens
        now = device_time(input_ids.device)
        # (a row that had stopped has no budget left, so `left` alone says it)
        full = all(n >= w for n in left)
        stats.record(w, w0, kept_rows, layer0, seconds=now - last, full=full)
        last = now
        if recorder is not None:
            recorder.end(r.block, w, kept_rows[0], r.routing, done[0])
    stats.decode_seconds = device_time(input_ids.device) - started
    seq = assemble(rows, generation_config)
    return seq, tuple(scores) if want_scores else None, tuple(raw_logits) if want_logits else None, stats


def assemble(rows: list[torch.Tensor], generation_config) -> torch.Tensor:
    """`[B, n]` from each row's `[1, n_b]` sequence: rows that stopped early end in the pad token,
    as transformers' batched `generate` pads a finished row (its `pad_token_id`, or the first EOS
    id when that is None: `_prepare_special_tokens`)."""
    n = max(r.shape[1] for r in rows)
    if all(r.shape[1] == n for r in rows):
        return torch.cat(rows)
    pad = generation_config._pad_token_tensor
    if pad is None:
        raise ValueError("rows of the batch stopped at different lengths and the generation config has no "
                         "pad_token_id to fill them with")
    out = torch.full((len(rows), n), int(pad), dtype=rows[0].dtype, device=rows[0].device)
    for b, r in enumerate(rows):
        out[b, : r.shape[1]] = r[0]
    return out
