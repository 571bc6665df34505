"""transformers integration: a tiny Qwen3.5-MoE with experts_implementation="hybridspec" matches "eager"."""

import pytest
import torch

import hybridspec.experts
import hybridspec.ops.naive_moe
from hybridspec.ops.dispatch import launch_counts
from tests.helpers import assert_rel


def _tiny_config(**kwargs):
    from transformers import Qwen3_5MoeTextConfig

    # 3 GDN : 1 attention layers, 2:1 value:key heads, several experts, top-k > 1
    return Qwen3_5MoeTextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=8, num_experts_per_tok=3, **kwargs,
    )


def _logits_pair(device, monkeypatch, tol):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    hybridspec.experts.register()
    torch.manual_seed(0)
    eager = Qwen3_5MoeForCausalLM(_tiny_config(experts_implementation="eager")).to(device).eval()
    ours = Qwen3_5MoeForCausalLM(_tiny_config(experts_implementation="hybridspec")).to(device).eval()
    ours.load_state_dict(eager.state_dict())
    assert ours.model.layers[0].mlp.experts.config._experts_implementation == "hybridspec"

    calls = []
    naive = hybridspec.ops.naive_moe.moe_experts
    monkeypatch.setattr(hybridspec.ops.naive_moe, "moe_experts", lambda *a: calls.append(1) or naive(*a))
    before = launch_counts["moe_reduce"]
    tokens = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        ref = eager(tokens).logits
        out = ours(tokens).logits
    # one op call per MoE layer, on the naive twin (CPU) or the kernels (CUDA: one 16-row piece)
    assert len(calls) + launch_counts["moe_reduce"] - before == 4
    assert_rel(out, ref, tol, "logits hybridspec vs eager")
    return ours


def test_tiny_model_matches_eager(monkeypatch):
    _logits_pair("cpu", monkeypatch, 1e-5)


@pytest.mark.gpu
def test_tiny_model_matches_eager_cuda(monkeypatch):
    # looser than on CPU: cuBLAS and the kernels sum in different orders, and 4 layers amplify it
    _logits_pair("cuda", monkeypatch, 1e-4)


def test_switch_on_loaded_model_and_reject_other_layouts(tmp_path):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    assert hybridspec.experts.register() == "hybridspec"
    Qwen3_5MoeForCausalLM(_tiny_config()).save_pretrained(tmp_path)
    model = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path, experts_implementation="hybridspec")
    assert model.config._experts_implementation == "hybridspec"
    model.set_experts_implementation("eager")
    model.set_experts_implementation("hybridspec")
    experts = model.model.layers[0].mlp.experts
    experts.has_bias = True
    with pytest.raises(ValueError, match="has_bias=True"):
        experts(torch.randn(2, 64), torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.rand(2, 3))
