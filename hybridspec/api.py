"""`hybridspec.enable(model)` / `hybridspec.disable(model)`: route `generate(..., hybridspec=True)`.

`enable` replaces the instance's `generate` with a wrapper. Without `hybridspec=True` the wrapper
calls the original untouched. With it, the wrapper validates the request and calls transformers'
own `generate` with our decoding method as `custom_generate`, so generation config, length limits,
EOS lists, logits processors, stopping criteria and streamers are prepared by transformers.
"""

from __future__ import annotations

import functools

import torch

from transformers import GenerationMixin
from transformers.generation import logits_process
from transformers.generation.stopping_criteria import MaxTimeCriteria

from hybridspec.cache import BoundedCache
from hybridspec.calibration.artifact import Calibration, current_device_name, runtime_versions
from hybridspec.drafter.protocol import DeviceDrafter
from hybridspec.fingerprint import drafter_fingerprint, target_fingerprint
from hybridspec.generation.loop import hybridspec_decode
from hybridspec.generation.options import BATCH_POLICIES, POLICIES, HybridSpecOptions
from hybridspec.inputs import check_attention_mask, check_input_ids
from hybridspec.parallel import generator_digests, model_group
from hybridspec.patches import family_of
from hybridspec.patches.fusion import unfuse_model
from hybridspec.patches.tp import check_sharding
from hybridspec.policy import FixedPolicy, default_policy, from_calibration, graph_batch_size
from hybridspec.runner.decode import release_runner
from hybridspec.state import MAX_VERIFY

_ORIGINAL = "_hybridspec_original_generate"
# policies built from calibration artifacts, recognised across calls (a few artifacts per process)
_CALIBRATED = BoundedCache(16)
# processors that run a model or keep state across calls cannot be replayed per verified position
_UNSUPPORTED_PROCESSORS = tuple(
    getattr(logits_process, name)
    for name in ("UnbatchedClassifierFreeGuidanceLogitsProcessor", "ClassifierFreeGuidanceLogitsProcessor",
                 "SynthIDTextWatermarkLogitsProcessor")
    if hasattr(logits_process, name)
)


def enable(model):
    """Patch `model` in place (idempotent) so that `generate(..., hybridspec=True)` works. Returns it.

    `model`: a Qwen3.5/3.6-MoE (`*ForCausalLM` or the checkpoints' `*ForConditionalGeneration`) or
    Qwen3-Next target. Then `model.generate(...)` takes, besides everything transformers takes:

        hybridspec=False         True routes the call through hybridspec; without it generate is stock
        assistant_model=         the drafter, a `hybridspec.DFlashDrafter` (required with hybridspec=True)
        verify_length=None       fixed target tokens per round including the anchor, 2..block size
        policy="hybridspec"      adaptive length per round; "nominal", "no_two_stage", "static", "dcut", "evict"
        calibration=None         artifact path or `Calibration` from `hybridspec calibrate` (static/dcut/evict need one)
        enforce_eager=False      the runner without CUDA graphs or torch.compile (debugging)
        reference_loop=False     the host-driven reference loop even where the runner could serve the call

    With `return_dict_in_generate=True` the output also has `hybridspec_stats` (per-round
    `verify_lengths`, `nominal_lengths`, `accepted`; `rounds`, `mean_acceptance_length`,
    `decode_seconds`, `prefill_seconds`: the time to the first token). Batches of 1 to 4 rows, left-padded with an `attention_mask` (what tokenizers
    give with `padding_side="left"`); more rows, right padding and beam search raise. At batch size
    2 and more, one length serves the whole batch per round: `verify_length`, `policy="hybridspec"` or
    `"static"`. `disable(model)` undoes it.
    """
    check_sharding(family_of(model), model)
    if getattr(model, _ORIGINAL, None) is None:
        setattr(model, _ORIGINAL, model.generate)
        model.generate = functools.partial(_generate, model)
    return model


def disable(model):
    """Undo `enable`: free the cached runner (its CUDA graphs, KV and state buffers) and give each
    fused projection its weight back (`hybridspec.fused`); a model that was never enabled is
    returned as it is."""
    original = model.__dict__.pop(_ORIGINAL, None)
    if original is not None:
        model.__dict__.pop("generate", None)
    release_runner(model)
    if original is not None:
        # each projection its own weight again, as before the first hybridspec call
        unfuse_model(family_of(model), model)
    return model


def _generate(model, *args, hybridspec: bool = False, verify_length: int | None = None, policy: str | None = None,
              calibration=None, hybridspec_recorder=None, hybridspec_accept=None, enforce_eager: bool | None = None,
              reference_loop: bool | None = None, **kwargs):
    original = getattr(model, _ORIGINAL)
    if not hybridspec:
        extra = [n for n, v in (("verify_length", verify_length), ("policy", policy), ("calibration", calibration),
                                ("enforce_eager", enforce_eager), ("reference_loop", reference_loop),
                                ("hybridspec_recorder", hybridspec_recorder), ("hybridspec_accept", hybridspec_accept))
                 if v is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} only apply with hybridspec=True")
        return original(*args, **kwargs)
    drafter = kwargs.pop("assistant_model", None)
    if drafter is None:
        raise ValueError("hybridspec=True needs a drafter: generate(..., assistant_model=drafter, hybridspec=True)")
    batch_size = _check_request(model, args, kwargs)
    drafter.bind(model)
    if batch_size > 1 and not isinstance(drafter, DeviceDrafter):
        raise ValueError(f"batched decoding drafts every row on the device: {type(drafter).__name__} drafts on the "
                         "host (a DeviceDrafter, e.g. hybridspec.DFlashDrafter, decodes batches)")
    length_policy = _policy(model, drafter, verify_length, policy, calibration, batch_size)
    options = HybridSpecOptions(drafter=drafter, policy=length_policy, streamer=kwargs.get("streamer"),
                                recorder=hybridspec_recorder, accept=hybridspec_accept, enforce_eager=bool(enforce_eager),
                                reference_loop=bool(reference_loop))
    return GenerationMixin.generate(model, *args, custom_generate=hybridspec_decode,
                                    hybridspec_options=options, **kwargs)


def _policy(model, drafter, verify_length, policy, calibration, batch_size: int = 1):
    """The length policy of one call: a fixed `verify_length`, or `policy` (default "hybridspec"),
    calibrated when `calibration` (an artifact path or a `Calibration`) is given. At batch size 2
    and more (a batch of 3 uses the batch-4 calibration) one length per round serves the batch."""
    top = min(drafter.block_size, MAX_VERIFY)
    if verify_length is not None:
        if policy is not None or calibration is not None:
            raise ValueError("verify_length fixes the length: it cannot be combined with policy= or calibration=")
        if not 2 <= verify_length <= top:
            raise ValueError(f"verify_length must be in 2..{top} (the drafter's block size), got {verify_length}")
        return FixedPolicy("fixed", verify_length)
    policy = policy or "hybridspec"
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if batch_size > 1 and policy not in BATCH_POLICIES:
        raise ValueError(f"policy={policy!r} is not supported for a batch of {batch_size}: batched rounds share one "
                         f"length, chosen by verify_length= or policy= one of {BATCH_POLICIES}")
    size = graph_batch_size(batch_size)
    if calibration is None:
        if policy in ("static", "dcut", "evict"):
            raise ValueError(f"policy={policy!r} needs profiled costs: run `hybridspec calibrate` and pass "
                             "generate(..., calibration=path)")
        return default_policy(policy, top, size)
    if not isinstance(calibration, Calibration):
        calibration = Calibration.load(calibration)
    device = model.get_output_embeddings().weight.device
    calibration.check(target_fingerprint(model), drafter_fingerprint(drafter), current_device_name(device),
                      runtime_versions())
    # one policy object per (artifact, name, length, batch size): the runner cache recognises it on
    # the next call. The entry holds the artifact too, so its id is not reused while the entry lives.
    entry = _CALIBRATED.get((id(calibration), policy, top, size),
                            lambda: (calibration, from_calibration(policy, calibration, top, size)))
    return entry[1]


def _check_request(model, args, kwargs) -> int:
    """Checks of the call before transformers prepares it; returns its batch size."""
    config = kwargs.get("generation_config") or model.generation_config
    merged = {**config.to_dict(), **kwargs}
    for name in ("num_beams", "num_return_sequences"):
        if (merged.get(name) or 1) > 1:
            raise ValueError(f"{name}={merged[name]} is not supported with hybridspec=True")
    for name in ("output_attentions", "output_hidden_states"):
        if merged.get(name):
            raise ValueError(f"{name}=True is not supported with hybridspec=True")
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    check_input_ids(model, inputs)
    check_attention_mask(kwargs.get("attention_mask"))
    batch_size = inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else 1
    if batch_size > 1:
        if kwargs.get("streamer") is not None:
            # transformers' own streamers refuse batches; say so before any work
            raise ValueError("streamers only support batch size 1 (transformers' TextStreamer), got a batch of "
                             f"{batch_size}")
        for name in ("output_scores", "output_logits"):
            if merged.get(name):
                raise ValueError(f"{name}=True is not supported with hybridspec=True for a batch (rows advance by "
                                 "different numbers of tokens per round); decode the rows one at a time")
        if kwargs.get("prefix_allowed_tokens_fn") is not None:
            # the reference loop processes each row as a batch of one, so transformers'
            # PrefixConstrainedLogitsProcessor would pass batch_id 0 for every row
            raise ValueError("prefix_allowed_tokens_fn is not supported with hybridspec=True for a batch (its batch_id "
                             "would not reach the rows); decode the rows one at a time")
    for proc in kwargs.get("logits_processor") or []:
        if isinstance(proc, _UNSUPPORTED_PROCESSORS):
            raise ValueError(f"{type(proc).__name__} cannot be applied per verified position")
    if merged.get("guidance_scale") not in (None, 1, 1.0):
        raise ValueError("guidance_scale (classifier-free guidance) is not supported with hybridspec=True")
    if merged.get("watermarking_config") is not None:
        raise ValueError("watermarking_config is not supported with hybridspec=True")
    group = model_group(model)
    if group is not None:
        timed = merged.get("max_time") is not None or any(
            isinstance(c, MaxTimeCriteria) for c in kwargs.get("stopping_criteria") or [])
        if timed:
            raise ValueError("max_time (or a MaxTimeCriteria) is not supported on a tensor-parallel model: each rank "
                             "would stop at its own clock, at different tokens, and the ranks' collectives would no "
                             "longer match. Bound the output with max_new_tokens")
        if merged.get("do_sample"):
            device = model.get_output_embeddings().weight.device
            digests = generator_digests(group, device)
            if len(set(digests)) > 1:
                # different draws would emit different tokens per rank and, in the reference loop,
                # verify different lengths: mismatched collectives, garbage or a hang
                raise ValueError("sampling on a tensor-parallel model needs the same random state on every rank: "
                                 f"call torch.manual_seed(seed) with one seed on every rank before generate "
                                 f"(generator digests per rank: {digests})")
    return batch_size
