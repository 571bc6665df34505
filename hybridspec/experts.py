"""The "hybridspec" experts implementation for transformers' `ExpertsInterface`.

Call `hybridspec.experts.register()` once (it is idempotent; importing this module does not
register, so `import hybridspec` never touches transformers). Then an experts implementation
named "hybridspec" runs `hybridspec.ops.moe_experts` for every experts module decorated with
`@use_experts_implementation` in the `Qwen3_5MoeExperts` layout:

    hybridspec.experts.register()
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="hybridspec")
    # or, on a loaded model: model.set_experts_implementation("hybridspec")

transformers (5.17 through 5.24) validates the name against `ExpertsInterface` when a model is
built or switched, so `register()` must run before that. The op has no autograd formula: this is
an inference path (a backward through it raises).
"""

from __future__ import annotations

import torch

from hybridspec.ops.moe import moe_experts
from hybridspec.ops.moe_partials import moe_combine, moe_experts_partials
from hybridspec.parallel import local

NAME = "hybridspec"


def _check_supported(experts: torch.nn.Module) -> None:
    # The op implements one layout: concatenated [gate; up] rows, untransposed, no bias, SwiGLU.
    unsupported = [
        flag
        for flag, bad in (
            ("has_gate=False", not getattr(experts, "has_gate", True)),
            ("has_bias=True", getattr(experts, "has_bias", False)),
            ("is_transposed=True", getattr(experts, "is_transposed", False)),
            ("is_concatenated=False", not getattr(experts, "is_concatenated", True)),
            ("has_post_expert_norm=True", getattr(experts, "has_post_expert_norm", False)),
            ("expert parallelism", getattr(experts, "_is_expert_parallel", False)),
        )
        if bad
    ]
    act = getattr(experts.config, "hidden_act", None)
    if act not in ("silu", "swish"):
        unsupported.append(f"hidden_act={act!r}")
    if unsupported:
        raise ValueError(
            f'experts_implementation="{NAME}" supports SwiGLU experts with concatenated, untransposed '
            f"gate_up_proj [E, 2I, H] and down_proj [E, H, I]; {type(experts).__name__} has "
            + ", ".join(unsupported)
        )


def hybridspec_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_tokens: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    combine_here: bool = False,
) -> torch.Tensor:
    """Signature of transformers' experts functions: `self` is the experts module, `hidden_states`
    `[T, H]`, `top_k_index` / `top_k_weights` `[T, k]`; returns `[T, H]` in the hidden dtype.
    `num_tokens` (hybridspec's own callers): rows past it are zero and read no expert. `shared`
    (hybridspec's own callers, unsharded experts): the block's shared expert and gate logits, which
    the op adds as transformers' sparse MoE block does (`moe_experts`' `shared`).

    Under transformers' tensor-parallel plan the weights are this rank's slice of every expert's
    width and the result is this rank's partial sum: transformers' experts hook swaps in the local
    shards and sums over the ranks around this call; hybridspec's verification forward, which calls
    it directly, takes the local shards here and sums itself (`patches.common.moe_apply`).

    `combine_here` (hybridspec's own callers, inside a compiled region): the op without its reduce
    (`moe_experts_partials`) and the weighted sum in plain torch (`moe_combine`), which the
    compiler fuses into whatever reads the result: the same sums, one launch fewer."""
    _check_supported(self)
    gate_up, down = local(self.gate_up_proj), local(self.down_proj)
    x = hidden_states.to(gate_up.dtype)
    if combine_here:
        y = moe_experts_partials(x, top_k_index, gate_up, down, num_tokens=num_tokens,
                                 shared=None if shared is None else shared[:2])
        out = moe_combine(y, top_k_index, top_k_weights, gate_up.shape[0], gate_up.dtype, num_tokens=num_tokens,
                          shared_gate=None if shared is None else shared[2])
    else:
        out = moe_experts(x, top_k_index, top_k_weights, gate_up, down, num_tokens=num_tokens, shared=shared)
    return out.to(hidden_states.dtype)


def register() -> str:
    """Add "hybridspec" to transformers' `ExpertsInterface` (all instances); returns the name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, hybridspec_experts_forward)
    return NAME
