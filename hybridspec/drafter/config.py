"""`DFlashConfig`: the z-lab DFlash checkpoint config (a Qwen3 config plus `dflash_config`).

The drafter's layers are described by a transformers `Qwen3Config` built from the same JSON, so
legacy keys (`rope_theta`, `rope_scaling`) and derived values (`layer_types` from
`use_sliding_window` / `max_window_layers`, `sliding_window` cleared unless `use_sliding_window`)
resolve exactly as they do for the upstream reference model (PyPI `dflash`), which builds its
layers from `Qwen3Config` too. DFlash fields are read from `dflash_config` first, then from the
top level, as the reference does.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass

from transformers import Qwen3Config

# RoPE types whose frequencies do not depend on the sequence length seen so far: cached context
# keys stay valid. "dynamic" and "longrope" recompute frequencies from the longest position.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# dflash_config keys of drafter variants this module does not implement (DFlash 2, DSpark, ...).
UNSUPPORTED_DFLASH_KEYS = (
    "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
    "projector_type", "linear_context",
)


def _dflash_value(raw: dict, name: str, default=None):
    section = raw.get("dflash_config") or {}
    if name in section:
        return section[name]
    return raw.get(name, default)


def _default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    # The reference's rule for checkpoints that name no taps: evenly spread over layers 1..L-3.
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter config. `text` describes the drafter's decoder layers; `raw` is the JSON it
    came from (saved back unchanged apart from the fields below).

    `target_layer_ids`: tap i is the output of target layer i (`hidden_states[i + 1]`), concatenated
    in this order. `block_size` W: the drafter fills `[anchor, mask * (W - 1)]`, D = W - 1 drafts.
    """

    text: Qwen3Config
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    num_target_layers: int | None
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    raw: dict

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size - 1

    def layer_attention(self, layer_idx: int) -> tuple[bool, int | None]:
        """(is_causal, sliding_window) of one drafter layer.

        As in the reference: a sliding layer is causal within the block and a full layer is not,
        unless a top-level `is_causal` overrides both."""
        sliding = self.text.layer_types[layer_idx] == "sliding_attention"
        forced = getattr(self.text, "is_causal", None)
        causal = sliding if forced is None else bool(forced)
        return causal, (self.text.sliding_window if sliding else None)

    @classmethod
    def from_dict(cls, raw: dict) -> "DFlashConfig":
        raw = copy.deepcopy(raw)
        _check_variant(raw)
        text = Qwen3Config(**{k: v for k, v in raw.items() if k != "model_type"})
        _check_layers(text)

        num_target_layers = raw.get("num_target_layers")
        taps = _dflash_value(raw, "target_layer_ids")
        if taps is None:
            if num_target_layers is None:
                raise ValueError(
                    "DFlash config names no taps: set dflash_config.target_layer_ids "
                    "(or num_target_layers to derive them)"
                )
            taps = _default_target_layer_ids(int(num_target_layers), text.num_hidden_layers)
        if not taps or not all(isinstance(t, int) and not isinstance(t, bool) for t in taps):
            raise ValueError(f"dflash_config.target_layer_ids must be a non-empty list of ints, got {taps!r}")
        mask_token_id = _dflash_value(raw, "mask_token_id")
        if not isinstance(mask_token_id, int) or mask_token_id < 0:
            raise ValueError(f"dflash_config.mask_token_id must be a non-negative int, got {mask_token_id!r}")
        block_size = _dflash_value(raw, "block_size", 16)
        if not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an int >= 2 (anchor plus drafts), got {block_size!r}")
        softcap = _dflash_value(raw, "final_logit_softcapping")
        return cls(
            text=text,
            target_layer_ids=tuple(taps),
            mask_token_id=mask_token_id,
            block_size=block_size,
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            input_embedding_scale=float(_dflash_value(raw, "input_embedding_scale", 1.0)),
            output_multiplier=float(_dflash_value(raw, "output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
            raw=raw,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "DFlashConfig":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        """The JSON written by `save_pretrained`: `raw` with the DFlash fields where the reference
        and the z-lab checkpoints keep them."""
        out = copy.deepcopy(self.raw)
        out.setdefault("architectures", ["DFlashDraftModel"])
        out.setdefault("model_type", "qwen3")
        section = dict(out.get("dflash_config") or {})
        section["target_layer_ids"] = list(self.target_layer_ids)
        section["mask_token_id"] = self.mask_token_id
        if "block_size" in section or "block_size" not in out:
            section["block_size"] = self.block_size
        else:
            out["block_size"] = self.block_size
        out["dflash_config"] = section
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        return out


def _check_variant(raw: dict) -> None:
    arch = raw.get("architectures") or []
    if any("DFlash2" in a for a in arch):
        raise ValueError(f"DFlash 2 checkpoints (architectures={arch}) are not supported; DFlash (v1) only")
    section = raw.get("dflash_config") or {}
    bad = [k for k in UNSUPPORTED_DFLASH_KEYS if section.get(k) is not None or raw.get(k) is not None]
    if section.get("sample_from_anchor"):
        bad.append("sample_from_anchor")
    if bad:
        raise ValueError(f"unsupported DFlash variant: config sets {', '.join(bad)}")


def _check_layers(text: Qwen3Config) -> None:
    unknown = sorted(set(text.layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise ValueError(f"unsupported drafter layer_types {unknown}; supported: {list(SUPPORTED_LAYER_TYPES)}")
    if "sliding_attention" in text.layer_types and text.sliding_window is None:
        # transformers' Qwen3Config clears sliding_window unless use_sliding_window is true; the
        # torch and MLX references then disagree on the window, so refuse rather than guess.
        raise ValueError(
            "layer_types has sliding_attention layers but no sliding window is in effect "
            f"(use_sliding_window={text.use_sliding_window}); set use_sliding_window=true and sliding_window"
        )
    if text.sliding_window is not None and text.sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {text.sliding_window}")
    rope = text.rope_parameters or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"per-layer-type rope_parameters are not supported: {rope}")
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported (1.0 only)")
