"""Weights asked into L2 by the verify and decode-attention kernels (hybridspec/ops/prefetch.py):
which weights a layer names, which the kernel takes, and on the GPU that asking changes no bit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hybridspec.ops import decode_attention, gdn_verify_packed
from hybridspec.ops import prefetch as prefetch_mod
from hybridspec.ops.prefetch import MAX_REGIONS, PrefetchConfig, checked_regions, prefetch_args
from hybridspec.patches import family_of
from hybridspec.patches.common import weights_after_mixer
from hybridspec.patches.fusion import fuse_model
from hybridspec.fused import fused_weight
from tests.models import qwen35_causal_lm


def test_a_layer_names_its_output_projection_then_the_moe_blocks_weights():
    model = qwen35_causal_lm()
    family = family_of(model)
    fuse_model(family, model)
    layers = family.text_model(model).layers
    kinds = family.text_config(model).layer_types
    for layer, kind in zip(layers, kinds):
        mixer = layer.linear_attn if kind == "linear_attention" else layer.self_attn
        out = mixer.out_proj if kind == "linear_attention" else mixer.o_proj
        got = weights_after_mixer(out, layer.mlp)
        want = [out.weight, fused_weight(layer.mlp, "moe"), layer.mlp.shared_expert.down_proj.weight]
        assert len(got) == len(want) <= MAX_REGIONS
        assert all(g is w for g, w in zip(got, want))


def test_an_unfused_block_names_only_what_is_plain():
    model = qwen35_causal_lm()
    layer = family_of(model).text_model(model).layers[0]
    got = weights_after_mixer(layer.linear_attn.out_proj, layer.mlp)
    assert [t.data_ptr() for t in got] == [layer.linear_attn.out_proj.weight.data_ptr(),
                                           layer.mlp.shared_expert.down_proj.weight.data_ptr()]


def test_off_or_off_the_gpu_the_kernel_gets_no_region(monkeypatch):
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    ref = torch.zeros(4)
    for mode in (0, 1):
        monkeypatch.setattr(prefetch_mod, "KERNEL_CONFIG", PrefetchConfig(mode=mode))
        args = prefetch_args([w], ref, num_warps=4)
        assert args["NUM_PF"] == 0 and args["PF_THREADS"] == 128
        assert all(args[f"pf{i}_bytes"] == 0 for i in range(MAX_REGIONS))


def test_the_wrappers_refuse_more_regions_than_the_kernels_take():
    w = torch.zeros(4)
    assert checked_regions((w, w)) == [w, w]
    with pytest.raises(ValueError, match="at most 3"):
        checked_regions([w] * 4)
    with pytest.raises(ValueError, match="at most 3"):
        checked_regions([w, "weight"])
    q = torch.zeros(1, 1, 2, 16)
    kv = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="at most 3"):
        decode_attention(q, kv, kv, torch.tensor([2]), prefetch=[kv] * 4)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [1, 2])
def test_asking_for_weights_changes_no_bit(monkeypatch, mode):
    """The 35B-A3B shapes at one and 16 rows: the verify kernel and decode attention with three
    regions (an out projection, a fused MoE weight, a down projection) asked into L2 give the bits
    they give without; a region at an address not 16-byte aligned is left out."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the prefetch instructions need sm90")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    regions = [torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16, generator=g),
               torch.randn(1296, 2048, device=dev, dtype=torch.bfloat16, generator=g),
               torch.randn(2048, 512, device=dev, dtype=torch.bfloat16, generator=g)]
    misaligned = regions[2].view(-1)[1:]
    monkeypatch.setattr(prefetch_mod, "KERNEL_CONFIG", PrefetchConfig(mode=mode))
    args = prefetch_args(regions + [misaligned], regions[0], num_warps=4)
    assert args["NUM_PF"] == 3 and args["pf0_bytes"] == 2048 * 4096 * 2
    assert prefetch_args([misaligned], regions[0], num_warps=4)["NUM_PF"] == 0
    HK, HV, K, V = 16, 32, 128, 128
    for w in (1, 16):
        qkv = torch.randn(1, w, 2 * HK * K + HV * V, device=dev, dtype=torch.bfloat16, generator=g)
        gate = -torch.rand(1, w, HV, device=dev, generator=g)
        beta = torch.rand(1, w, HV, device=dev, generator=g).to(torch.bfloat16)
        state = torch.randn(1, HV, K, V, device=dev, generator=g) * 0.1
        q = torch.randn(1, w, 16, 256, device=dev, dtype=torch.bfloat16, generator=g)
        kv = torch.randn(1, 2, 600, 256, device=dev, dtype=torch.bfloat16, generator=g)
        length = torch.tensor([512], device=dev)
        outs = {}
        for on in (False, True):
            monkeypatch.setattr(prefetch_mod, "KERNEL_CONFIG", PrefetchConfig(mode=mode if on else 0))
            pf = regions if on else ()
            o, factors = gdn_verify_packed(qkv, gate, beta, state, num_k_heads=HK, head_k_dim=K, head_v_dim=V,
                                           prefetch=pf)
            a = decode_attention(q, kv, kv, length, prefetch=pf)
            outs[on] = (o, *factors, a)
        for off, on in zip(outs[False], outs[True]):
            assert torch.equal(off, on)
