"""`generate(..., hybridspec=True)` on the runner: which calls it serves, and the cached runner.

The runner serves greedy and sampled decoding with context-free warpers (temperature, top-k,
top-p, min-p), length / EOS / time limits, streamers, and device-resident drafters. Anything else
(processors that read the sequence, stop strings or custom criteria, `output_scores` /
`output_logits`, calibration's recorder, host-driven drafters) runs the reference loop of
`hybridspec.generation.loop`, which a warning names on CUDA, where the difference is speed.
"""

from __future__ import annotations

import warnings

import torch
from transformers.generation import logits_process

from hybridspec.cache import BoundedCache
from hybridspec.drafter.protocol import DeviceDrafter
from hybridspec.policy import BATCH_SIZES, FixedPolicy, RatioPolicy
from hybridspec.round.round import Sampler
from hybridspec.round.stopping import HostStopping
from hybridspec.runner.runner import Runner

_CONTEXT_FREE = tuple(
    getattr(logits_process, name)
    for name in ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                 "InfNanRemoveLogitsProcessor")
    if hasattr(logits_process, name)
)
_ATTR = "_hybridspec_runner"
# reasons already warned about (one warning per reason and process)
_WARNED = BoundedCache(64)


def runner_blocker(opts, logits_processor, stopping_criteria, generation_config) -> str | None:
    """Why this call cannot run on the runner, or None."""
    if opts.reference_loop:
        return "reference_loop=True"
    if opts.recorder is not None:
        return "calibration records rounds"
    if generation_config.output_scores or generation_config.output_logits:
        return "output_scores / output_logits need per-position scores on the host"
    if not isinstance(opts.drafter, DeviceDrafter):
        return f"the drafter {type(opts.drafter).__name__} drafts on the host"
    odd = [type(p).__name__ for p in logits_processor or [] if not isinstance(p, _CONTEXT_FREE)]
    if odd:
        return f"logits processors that read the sequence ({', '.join(odd)})"
    if HostStopping.from_criteria(stopping_criteria, generation_config.max_length) is None:
        return "stopping criteria other than length, EOS and max_time"
    return None


def warn_fallback(model, reason: str) -> None:
    """Say once per reason, on CUDA only (on the CPU both paths run eagerly)."""
    if model.get_output_embeddings().weight.device.type == "cuda" and _WARNED.first_time(reason):
        warnings.warn(f"hybridspec: {reason}, so this call runs the reference loop without CUDA graphs", stacklevel=5)


def _policy_key(policy):
    """Fixed and ratio policies compare by value; an adaptive one (it holds tensors and a fitted
    model) by identity: reuse a loaded `Calibration` object to reuse its captured round."""
    if isinstance(policy, (FixedPolicy, RatioPolicy)):
        return policy
    return id(policy)


def _sampler(logits_processor, generation_config, rule=None) -> tuple[Sampler, tuple]:
    warpers = tuple(logits_processor or ())
    key = (generation_config.do_sample, id(rule)) + tuple(
        (type(p).__name__, tuple(sorted((k, repr(v)) for k, v in vars(p).items()))) for p in warpers
    )
    return Sampler(bool(generation_config.do_sample), warpers, rule), key


def _attr(batch_size: int) -> str:
    """The model attribute holding its runner for one batch size (batch one keeps the plain name)."""
    return _ATTR if batch_size == 1 else f"{_ATTR}_b{batch_size}"


def cached_runner(model, drafter, policy, logits_processor, generation_config, enforce_eager: bool,
                  rule=None, batch_size: int = 1) -> Runner:
    """The model's runner for this combination and batch size (1, 2 or 4: one runner, with its
    captured graphs, per size), built (and captured) when the last one of that size does not fit.
    Capacity is the call's `max_length` rounded up to a power of two (at least 256)."""
    sampler, sampler_key = _sampler(logits_processor, generation_config, rule)
    key = (id(drafter), _policy_key(policy), sampler_key, enforce_eager)
    need = generation_config.max_length
    attr = _attr(batch_size)
    runner = model.__dict__.get(attr)
    if runner is not None and runner.key == key and runner.capacity >= need and runner.drafter is drafter:
        return runner
    if runner is not None:
        _release(model, attr)
        del runner
    capacity = max(256, 1 << (need - 1).bit_length())
    runner = Runner(model, drafter, policy, capacity=capacity, sampler=sampler, enforce_eager=enforce_eager,
                    batch_size=batch_size)
    runner.key = key
    setattr(model, attr, runner)
    return runner


def runner_of(model) -> Runner | None:
    """The model's cached batch-one runner (that of its last batch-one `generate` call on the
    runner), if any."""
    return model.__dict__.get(_ATTR)


def release_runner(model) -> None:
    """Drop the model's cached runners (captured graphs, KV and state buffers) and return their memory."""
    for batch_size in BATCH_SIZES:
        _release(model, _attr(batch_size))


def _release(model, attr: str) -> None:
    runner = model.__dict__.pop(attr, None)
    if runner is not None:
        runner.release()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
