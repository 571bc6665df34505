"""The decoding method `generate(..., hybridspec=True)` hands to transformers as `custom_generate`.

Stages per round: draft, verify (one target pass over `[anchor, d_1 .. d_{w-1}]`), accept (per
position, the same logits processors greedy decoding applies), commit (m = A + 1 tokens into
every layer and the drafter). Stopping is checked token by token, as target-only decoding does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hybridspec.generation.options import HybridSpecOptions
from hybridspec.patches import family_of
from hybridspec.patches.forward import allocate_state, verify_forward


@dataclass
class HybridSpecStats:
    verify_lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens emitted per round, A + 1."""
        return sum(a + 1 for a in self.accepted) / max(1, len(self.accepted))


@dataclass
class HybridSpecOutput(GenerateDecoderOnlyOutput):
    hybridspec_stats: HybridSpecStats | None = None


def _prefill(model, input_ids, taps, cache_kwarg):
    cache = DynamicCache(config=model.config)
    out = model(input_ids, use_cache=True, output_hidden_states=bool(taps), logits_to_keep=1, **{cache_kwarg: cache})
    feats = torch.cat([out.hidden_states[i + 1] for i in taps], -1) if taps else input_ids.new_zeros(*input_ids.shape, 0)
    return out.logits[:, -1].float(), cache, feats


def hybridspec_decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                      synced_gpus=False, hybridspec_options: HybridSpecOptions | None = None, **model_kwargs):
    """Greedy speculative decoding, token for token equal to `generate(do_sample=False)`."""
    opts = hybridspec_options
    drafter, streamer = opts.drafter, opts.streamer
    family = family_of(model)
    # the drafter reads its taps concatenated in its own order
    taps = tuple(drafter.target_layer_ids)
    want_scores, want_logits = generation_config.output_scores, generation_config.output_logits
    scores, raw_logits = [], []
    stats = HybridSpecStats()
    seq = input_ids
    max_len = generation_config.max_length

    def emit(token_logits: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Process one position's logits after `context`, pick the greedy token, append, check stops."""
        nonlocal seq
        processed = logits_processor(context, token_logits)
        token = processed.argmax(-1, keepdim=True)  # [B, 1]
        if want_scores:
            scores.append(processed)
        if want_logits:
            raw_logits.append(token_logits)
        seq = torch.cat([context, token], dim=-1)
        if streamer is not None:
            streamer.put(token.cpu())
        return token, bool(stopping_criteria(seq, processed).all())

    logits, cache, feats = _prefill(model, input_ids, taps, opts.cache_kwarg)
    state = allocate_state(family, model, cache, max_len + 16)
    del cache
    drafter.start(input_ids, feats)
    anchor, done = emit(logits, seq)
    lm_head = model.get_output_embeddings()
    while not done:
        remaining = max_len - seq.shape[1]
        block = drafter.propose(seq)
        if opts.verify_length is None:
            # the eager loop slices by w, so it reads w0 on the host (the CUDA-graph runner does not)
            w = int(opts.policy.select(block.confidence, remaining)[0])
        else:
            w = max(1, min(opts.verify_length, remaining))
        draft = block.tokens[:, : w - 1]
        hidden, feats = verify_forward(family, model, torch.cat([anchor, draft], dim=-1), state, taps)
        logits = lm_head(hidden).float()  # [B, w, V]
        accepted = 0
        for i in range(w):
            token, done = emit(logits[:, i], seq)
            if done or i == w - 1 or not torch.equal(token, draft[:, i : i + 1]):
                break
            accepted += 1
        stats.verify_lengths.append(w)
        stats.accepted.append(accepted)
        anchor = token
        if not done:
            state.commit(accepted + 1)
            drafter.observe(feats, accepted + 1)
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
