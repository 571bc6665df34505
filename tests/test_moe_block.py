"""The sparse MoE block on hybridspec's verification path (`patches.common.moe_verify`) equals
transformers' own block, whichever way it runs the shared expert: inside the experts op as one
more expert (its projections fused and of the routed experts' width), through the fused GEMM and
its own down projection (a hooked down projection, a wider shared expert), or unfused."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from hybridspec.fused import fused_weight
from hybridspec.patches import family_of
from hybridspec.patches.common import moe_apply, moe_verify, route, shared_as_expert
from hybridspec.patches.fusion import fuse_model
from hybridspec.tiny import TARGET, tiny_next_target, tiny_target
from tests.helpers import assert_rel


def _wider_shared(seed: int):
    torch.manual_seed(seed)
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**TARGET, "shared_expert_intermediate_size": 48})).eval()


BUILDS = {"qwen3.5": tiny_target, "qwen3-next": tiny_next_target, "qwen3.5, wider shared expert": _wider_shared}


VARIANTS = ["as an expert", "hooked down projection", "hooked activation", "gelu shared expert", "unfused"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("build", list(BUILDS))
def test_block_equals_transformers(build, variant):
    model = BUILDS[build](seed=3)
    family = family_of(model)
    mlp = family.text_model(model).layers[1].mlp
    seen = []
    if variant == "hooked down projection":
        mlp.shared_expert.down_proj.register_forward_hook(lambda *a: seen.append(1))
    if variant == "hooked activation":
        mlp.shared_expert.act_fn.register_forward_hook(lambda *a: seen.append(1))
    if variant == "gelu shared expert":
        mlp.shared_expert.act_fn = torch.nn.GELU()
    torch.manual_seed(0)
    x = torch.randn(2, 5, model.config.hidden_size) * 3
    with torch.no_grad():
        ref = mlp(x)
        seen.clear()
        if variant != "unfused":
            fuse_model(family, model)
            assert fused_weight(mlp, "moe") is not None
        ninth = shared_as_expert(mlp)
        assert (ninth is not None) == (variant == "as an expert" and "wider" not in build)
        routing = []
        got = moe_verify(family, mlp, x, routing)
        assert_rel(got, ref, 1e-5, f"block ({build}, {variant})")
        assert seen == ([1] if "hooked" in variant else []), "a hooked module runs its module call"
        # each batch row's counted tokens: those rows are the block's; Stage 1's call (no fused
        # outputs passed in) gives the same; so does one row with a count (the op's own num_tokens)
        counts = torch.tensor([3, 5])
        ids, weights = route(family, mlp, x)
        assert torch.equal(ids, routing[0])
        for out in (moe_verify(family, mlp, x, num_tokens=counts), moe_apply(mlp, x, ids, weights, counts)):
            assert_rel(out[0, :3], ref[0, :3], 1e-5, "counted rows of batch row 0")
            assert_rel(out[1], ref[1], 1e-5, "batch row 1")
        one = moe_verify(family, mlp, x[1:], num_tokens=torch.tensor([4]))
        assert_rel(one[0, :4], ref[1, :4], 1e-5, "counted rows of a batch of one")


@pytest.mark.parametrize("build", ["qwen3.5", "qwen3-next"])
def test_bf16_block_is_transformers_block_in_other_arithmetic(build):
    """bf16: the block with the shared expert inside the experts op is transformers' block up to
    where they round (the op sums the routed experts in fp32 and rounds inside an expert once)."""
    model = BUILDS[build](seed=5).to(torch.bfloat16)
    family = family_of(model)
    mlp = family.text_model(model).layers[2].mlp
    x = torch.randn(1, 16, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = mlp(x)
        fuse_model(family, model)
        assert shared_as_expert(mlp) is not None
        assert_rel(moe_verify(family, mlp, x).float(), ref.float(), 2e-2, f"bf16 block ({build})")


def test_shared_expert_weights_are_views_of_the_fused_weight():
    """As an expert, the shared expert's gate and up rows are read in place: no second copy."""
    model = tiny_target(seed=1)
    family = family_of(model)
    fuse_model(family, model)
    mlp = family.text_model(model).layers[0].mlp
    gate_up, down = shared_as_expert(mlp)
    stacked = fused_weight(mlp, "moe")
    assert gate_up.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    assert torch.equal(gate_up, torch.cat([mlp.shared_expert.gate_proj.weight, mlp.shared_expert.up_proj.weight]))
    assert down is mlp.shared_expert.down_proj.weight


@pytest.mark.parametrize("build", ["qwen3.5", "qwen3-next"])
def test_compiled_block_adds_the_experts_in_the_residual_add(monkeypatch, build):
    """With `combine_in_consumer` on, a compiled verified block runs the experts op without its
    reduce (`moe_experts_partials`, here its twin) and adds the experts in torch: the eager path's
    hidden states (which take the whole op), for every sparse block, routed and shared experts."""
    from dataclasses import replace

    from transformers import DynamicCache

    from hybridspec.ops import moe as moe_ops
    from hybridspec.ops import naive_moe
    from hybridspec.patches.common import is_sparse_moe
    from hybridspec.patches.forward import Blocks, allocate_state, verify_forward

    model = BUILDS[build](seed=3)
    family = family_of(model)
    fuse_model(family, model)
    calls = []
    twin = naive_moe.moe_experts_partials
    monkeypatch.setattr(naive_moe, "moe_experts_partials", lambda *a: calls.append(a[5] is not None) or twin(*a))
    g = torch.Generator().manual_seed(4)
    prompt, block = (torch.randint(0, model.config.vocab_size, (1, n), generator=g) for n in (6, 5))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, use_cache=True, past_key_values=cache)
        state = allocate_state(family, model, cache, 32)
        eager, _ = verify_forward(family, model, block, state)
        assert not calls
        monkeypatch.setattr(moe_ops, "KERNEL_CONFIG", replace(moe_ops.KERNEL_CONFIG, combine_in_consumer=True))
        torch._dynamo.reset()
        blocks = Blocks(*(torch.compile(f, dynamic=False) for f in Blocks._field_defaults.values()))
        got, _ = verify_forward(family, model, block, state, blocks=blocks)
    sparse = sum(is_sparse_moe(layer.mlp) for layer in family.text_model(model).layers)
    assert len(calls) == sparse and all(calls), "every sparse block took the partials, with its shared expert"
    assert_rel(got, eager, 1e-5, "compiled with the sum in the residual add vs eager")
