"""`hybridspec.enable(model)` / `hybridspec.disable(model)`: route `generate(..., hybridspec=True)`.

`enable` replaces the instance's `generate` with a wrapper. Without `hybridspec=True` the wrapper
calls the original untouched. With it, the wrapper validates the request and calls transformers'
own `generate` with our decoding method as `custom_generate`, so generation config, length limits,
EOS lists, logits processors, stopping criteria and streamers are prepared by transformers.
"""

from __future__ import annotations

import functools
import inspect

from transformers import GenerationMixin
from transformers.generation import logits_process

from hybridspec.generation.loop import hybridspec_decode
from hybridspec.generation.options import POLICIES, HybridSpecOptions
from hybridspec.patches import family_of
from hybridspec.policy import default_policy

_ORIGINAL = "_hybridspec_original_generate"
# processors that run a model or keep state across calls cannot be replayed per verified position
_UNSUPPORTED_PROCESSORS = tuple(
    getattr(logits_process, name)
    for name in ("UnbatchedClassifierFreeGuidanceLogitsProcessor", "ClassifierFreeGuidanceLogitsProcessor",
                 "SynthIDTextWatermarkLogitsProcessor")
    if hasattr(logits_process, name)
)


def enable(model):
    """Patch `model` in place (idempotent) so that `generate(..., hybridspec=True)` works. Returns it."""
    family_of(model)
    if getattr(model, _ORIGINAL, None) is None:
        setattr(model, _ORIGINAL, model.generate)
        model.generate = functools.partial(_generate, model)
    return model


def disable(model):
    """Undo `enable`; a model that was never enabled is returned as it is."""
    original = model.__dict__.pop(_ORIGINAL, None)
    if original is not None:
        model.__dict__.pop("generate", None)
    return model


def _cache_kwarg(model) -> str:
    # transformers 5.24 renamed `past_key_values` to `cache` in forward signatures
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _generate(model, *args, hybridspec: bool = False, verify_length: int | None = None, policy: str | None = None,
              calibration=None, **kwargs):
    original = getattr(model, _ORIGINAL)
    if not hybridspec:
        extra = [n for n, v in (("verify_length", verify_length), ("policy", policy), ("calibration", calibration))
                 if v is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} only apply with hybridspec=True")
        return original(*args, **kwargs)
    drafter = kwargs.pop("assistant_model", None)
    if drafter is None:
        raise ValueError("hybridspec=True needs a drafter: generate(..., assistant_model=drafter, hybridspec=True)")
    policy = policy or "hybridspec"
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    length_policy = None
    if verify_length is None:
        # "hybridspec" adds the routing correction and two-stage verification to "nominal"
        # selection; both arrive with calibration (issue 4), so today the three run the same selector
        if policy not in ("hybridspec", "nominal", "no_two_stage"):
            raise ValueError(f"policy={policy!r} arrives with the calibrated length policy (issue 4); "
                             "use policy='hybridspec' or pass verify_length=w")
        if calibration is not None:
            raise ValueError("calibration artifacts arrive with `hybridspec calibrate` (issue 4)")
        length_policy = default_policy(min(drafter.block_size, 16))
    elif not 2 <= verify_length <= min(drafter.block_size, 16):
        raise ValueError(f"verify_length must be in 2..{min(drafter.block_size, 16)} (the drafter's block size), "
                         f"got {verify_length}")
    _check_request(model, args, kwargs)
    drafter.bind(model)
    streamer = kwargs.get("streamer")
    options = HybridSpecOptions(drafter=drafter, verify_length=verify_length, policy=length_policy,
                                streamer=streamer, cache_kwarg=_cache_kwarg(model))
    return GenerationMixin.generate(model, *args, custom_generate=hybridspec_decode,
                                    hybridspec_options=options, **kwargs)


def _check_request(model, args, kwargs) -> None:
    config = kwargs.get("generation_config") or model.generation_config
    merged = {**config.to_dict(), **kwargs}
    if merged.get("do_sample"):
        raise ValueError("do_sample=True with hybridspec=True arrives with the sampling issue (#8); use greedy decoding")
    for name in ("num_beams", "num_return_sequences"):
        if (merged.get(name) or 1) > 1:
            raise ValueError(f"{name}={merged[name]} is not supported with hybridspec=True")
    for name in ("output_attentions", "output_hidden_states"):
        if merged.get(name):
            raise ValueError(f"{name}=True is not supported with hybridspec=True")
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if inputs is not None and inputs.dim() == 2 and inputs.shape[0] != 1:
        raise ValueError(f"hybridspec decodes one sequence at a time; got input_ids {tuple(inputs.shape)}")
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
