"""`hybridspec.enable(model)` / `hybridspec.disable(model)`: route `generate(..., hybridspec=True)`.

`enable` replaces the instance's `generate` with a wrapper. Without `hybridspec=True` the wrapper
calls the original untouched. With it, the wrapper validates the request and calls transformers'
own `generate` with our decoding method as `custom_generate`, so generation config, length limits,
EOS lists, logits processors, stopping criteria and streamers are prepared by transformers.
"""

from __future__ import annotations

import functools

from transformers import GenerationMixin
from transformers.generation import logits_process

from hybridspec.cache import BoundedCache
from hybridspec.calibration.artifact import Calibration, current_device_name, runtime_versions
from hybridspec.fingerprint import drafter_fingerprint, target_fingerprint
from hybridspec.generation.loop import hybridspec_decode
from hybridspec.generation.options import POLICIES, HybridSpecOptions
from hybridspec.inputs import check_input_ids
from hybridspec.parallel import model_group
from hybridspec.patches import family_of
from hybridspec.patches.tp import check_sharding
from hybridspec.policy import FixedPolicy, default_policy, from_calibration
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
    `decode_seconds`). Batch size one; beam search and padded inputs raise. `disable(model)` undoes it.
    """
    check_sharding(family_of(model), model)
    if getattr(model, _ORIGINAL, None) is None:
        setattr(model, _ORIGINAL, model.generate)
        model.generate = functools.partial(_generate, model)
    return model


def disable(model):
    """Undo `enable` and free the cached runner (its CUDA graphs, KV and state buffers); a model
    that was never enabled is returned as it is."""
    original = model.__dict__.pop(_ORIGINAL, None)
    if original is not None:
        model.__dict__.pop("generate", None)
    release_runner(model)
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
    _check_request(model, args, kwargs)
    drafter.bind(model)
    length_policy = _policy(model, drafter, verify_length, policy, calibration)
    options = HybridSpecOptions(drafter=drafter, policy=length_policy, streamer=kwargs.get("streamer"),
                                recorder=hybridspec_recorder, accept=hybridspec_accept, enforce_eager=bool(enforce_eager),
                                reference_loop=bool(reference_loop))
    return GenerationMixin.generate(model, *args, custom_generate=hybridspec_decode,
                                    hybridspec_options=options, **kwargs)


def _policy(model, drafter, verify_length, policy, calibration):
    """The length policy of one call: a fixed `verify_length`, or `policy` (default "hybridspec"),
    calibrated when `calibration` (an artifact path or a `Calibration`) is given."""
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
    if calibration is None:
        if policy in ("static", "dcut", "evict"):
            raise ValueError(f"policy={policy!r} needs profiled costs: run `hybridspec calibrate` and pass "
                             "generate(..., calibration=path)")
        return default_policy(policy, top)
    if not isinstance(calibration, Calibration):
        calibration = Calibration.load(calibration)
    device = model.get_output_embeddings().weight.device
    calibration.check(target_fingerprint(model), drafter_fingerprint(drafter), current_device_name(device),
                      runtime_versions())
    # one policy object per (artifact, name, length): the runner cache recognises it on the next
    # call. The entry holds the artifact too, so its id is not reused while the entry lives.
    entry = _CALIBRATED.get((id(calibration), policy, top),
                            lambda: (calibration, from_calibration(policy, calibration, top)))
    return entry[1]


def _check_request(model, args, kwargs) -> None:
    config = kwargs.get("generation_config") or model.generation_config
    merged = {**config.to_dict(), **kwargs}
    for name in ("num_beams", "num_return_sequences"):
        if (merged.get(name) or 1) > 1:
            raise ValueError(f"{name}={merged[name]} is not supported with hybridspec=True")
    for name in ("output_attentions", "output_hidden_states"):
        if merged.get(name):
            raise ValueError(f"{name}=True is not supported with hybridspec=True")
    check_input_ids(model, args[0] if args else kwargs.get("input_ids", kwargs.get("inputs")))
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("padded inputs (attention_mask with zeros) are not supported with hybridspec=True")
    for proc in kwargs.get("logits_processor") or []:
        if isinstance(proc, _UNSUPPORTED_PROCESSORS):
            raise ValueError(f"{type(proc).__name__} cannot be applied per verified position")
    if merged.get("guidance_scale") not in (None, 1, 1.0):
        raise ValueError("guidance_scale (classifier-free guidance) is not supported with hybridspec=True")
    if merged.get("watermarking_config") is not None:
        raise ValueError("watermarking_config is not supported with hybridspec=True")
    if merged.get("max_time") is not None and model_group(model) is not None:
        raise ValueError("max_time is not supported on a tensor-parallel model: each rank would stop at its own "
                         "clock, at different tokens, and the ranks' collectives would no longer match. Bound the "
                         "output with max_new_tokens")
