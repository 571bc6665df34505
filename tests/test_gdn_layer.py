"""The families' GDN layer on the CPU without Triton: the fused op's naive twin and the unfused path
(conv, gates, `gdn_verify`) both continue transformers' module from its cache (the interpreted
kernels: tests/ops/test_gdn_conv.py)."""

import pytest
import torch

from tests.gdn_layer import check_against_transformers, layer_inputs, tiny_layer, verify_layer


@pytest.mark.parametrize("name", ["qwen35", "qwen3_next"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("w, n", [(1, None), (9, None), (16, 11), (3, 0)])
def test_layer_matches_transformers(name, fused, w, n):
    check_against_transformers(name, "cpu", fused, w, n)


@pytest.mark.parametrize("name", ["qwen35", "qwen3_next"])
def test_bf16_fused_twin_equals_unfused(name):
    """bf16: the twin computes what the unfused path does, so the layer's outputs are the same bits."""
    model, mod = tiny_layer(name, "cpu", dtype=torch.bfloat16)
    _, state, window, new = layer_inputs(model, mod, 13, 10)
    fused, fused_slot = verify_layer(model, new, state, window, 10, True)
    unfused, unfused_slot = verify_layer(model, new, state, window, 10, False)
    assert torch.equal(fused[:, :10], unfused[:, :10])
    torch.testing.assert_close(fused_slot.inputs, unfused_slot.inputs, rtol=0, atol=0, equal_nan=True)
