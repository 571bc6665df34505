"""Fingerprints that tie a calibration artifact to its target and drafter: sha256 of a config
without the keys that change between loads of the same checkpoint."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol, runtime_checkable

from hybridspec.patches import family_of

# Keys of a transformers config dict that change between loads of the same checkpoint (paths,
# versions, dtype, kernel choices, parallel plans, output switches) and not the model itself.
VOLATILE_KEYS = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures",
    "_commit_hash", "attn_implementation", "experts_implementation", "auto_map", "_auto_class",
    "_is_quantized", "_pre_quantization_dtype", "output_attentions", "_output_attentions",
    "output_hidden_states", "output_router_logits", "return_dict", "use_return_dict", "use_cache",
    "torchscript", "base_model_tp_plan", "base_model_pp_plan", "base_model_fsdp_plan", "tp_plan",
    "pp_plan", "distributed_config", "ignore_keys_at_rope_validation",
})
VOLATILE_PREFIXES = ("_attn_implementation", "_experts_implementation")


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            str(k): _stable(v) for k, v in value.items()
            if k not in VOLATILE_KEYS and not str(k).startswith(VOLATILE_PREFIXES)
        }
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    if hasattr(value, "to_dict"):
        return _stable(value.to_dict())
    return value


def fingerprint(config) -> str:
    """sha256 (hex) of a model config without its volatile keys (`VOLATILE_KEYS`, `VOLATILE_PREFIXES`,
    removed at every nesting level). `config`: a dict or anything with `to_dict()` (a transformers
    `PretrainedConfig`, `DFlashConfig`)."""
    d = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(d, dict):
        raise TypeError(f"fingerprint: expected a config dict or an object with to_dict(), got {type(config).__name__}")
    # default=str: values such as torch.dtype in hand-built dicts still hash deterministically
    text = json.dumps(_stable(d), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@runtime_checkable
class Fingerprinted(Protocol):
    """A drafter that can say what identifies it for calibration (its config; a replay drafter adds
    its fixed acceptance model, since its acceptance is not the wrapped drafter's)."""

    def fingerprint_config(self) -> dict:
        ...


def target_fingerprint(model) -> str:
    """The target's text config, fingerprinted for calibration artifacts."""
    return fingerprint(family_of(model).text_config(model).to_dict())


def drafter_fingerprint(drafter) -> str:
    if not isinstance(drafter, Fingerprinted):
        raise ValueError(f"cannot identify drafter {type(drafter).__name__} for calibration: it has no "
                         "fingerprint_config()")
    return fingerprint(drafter.fingerprint_config())
