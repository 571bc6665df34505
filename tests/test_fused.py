"""Fused projections (`hybridspec.fused`, `hybridspec.patches.fusion`): stored once, equal to the
separate linears, and never stale when the user changes weights between calls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridspec
from hybridspec.fused import PREFIX, fuse, fused_weight, project, refresh, unfuse_group
from hybridspec.patches import family_of
from hybridspec.patches.fusion import fuse_model, groups
from tests.helpers import assert_rel
from tests.models import qwen3_next_causal_lm, qwen35_causal_lm
from hybridspec.tiny import tiny_drafter

MAX_NEW = 12


def _linears(sizes=(24, 8, 3), H=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    parent = nn.Module()
    parent.lins = nn.ModuleList(nn.Linear(H, n, bias=False, dtype=dtype) for n in sizes)
    for lin in parent.lins:
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
    return parent, tuple(parent.lins)


def test_fused_weight_is_the_only_storage_and_matches_the_linears():
    parent, lins = _linears()
    before = [lin.weight.detach().clone() for lin in lins]
    x = torch.randn(5, 16)
    expected = [lin(x) for lin in lins]
    assert fuse(parent, "g", lins)
    stacked = fused_weight(parent, "g")
    assert stacked.shape == (48, 16), "35 rows padded to a multiple of 16"
    assert torch.equal(stacked[35:], torch.zeros(13, 16))
    for lin, w in zip(lins, before):
        assert torch.equal(lin.weight, w)
        assert lin.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr(), "a view, not a copy"
    assert PREFIX + "g" not in parent.state_dict(), "the fused buffer is not persistent"
    for got, want in zip(project(parent, "g", lins, x), expected):
        assert_rel(got, want, 1e-6, "fused projection")


def test_in_place_changes_reach_the_fused_weight_and_replaced_ones_are_copied_back():
    parent, lins = _linears()
    fuse(parent, "g", lins)
    address = fused_weight(parent, "g").data_ptr()
    x = torch.randn(2, 16)
    with torch.no_grad():
        lins[1].weight.mul_(3)  # in place: through the view
    assert_rel(project(parent, "g", lins, x)[1], lins[1](x), 1e-6, "after an in-place change")
    lins[0].weight = nn.Parameter(torch.randn(24, 16))  # replaced: no longer a view
    assert not torch.allclose(project(parent, "g", lins, x)[0], lins[0](x)), "stale until refreshed"
    refresh(parent, "g", lins)
    assert fused_weight(parent, "g").data_ptr() == address, "refreshed in place: captured graphs stay valid"
    for got, lin in zip(project(parent, "g", lins, x), lins):
        assert_rel(got, lin(x), 1e-6, "after refresh")
    parent.to(torch.float64)  # every weight replaced, of another dtype: a new fused weight
    refresh(parent, "g", lins)
    assert fused_weight(parent, "g").dtype == torch.float64
    for got, lin in zip(project(parent, "g", lins, x.double()), lins):
        assert_rel(got, lin(x.double()), 1e-12, "after a dtype change")


def test_unfusable_groups_are_left_alone_and_unfuse_restores_own_weights():
    parent, lins = _linears()
    lins[2].bias = nn.Parameter(torch.zeros(3))
    assert not fuse(parent, "g", lins) and fused_weight(parent, "g") is None
    assert project(parent, "g", lins, torch.randn(1, 16)) is None
    parent, lins = _linears()
    fuse(parent, "g", lins)
    values = [lin.weight.detach().clone() for lin in lins]
    unfuse_group(parent, "g", lins)
    assert fused_weight(parent, "g") is None
    ptrs = {lin.weight.untyped_storage().data_ptr() for lin in lins}
    assert len(ptrs) == 3 and all(torch.equal(lin.weight, v) for lin, v in zip(lins, values))


def test_parameters_keep_their_identity_for_optimizers_and_autograd():
    """Fusing re-points `param.data`: an optimizer made before fusing still trains the module, and
    its steps reach the fused weight."""
    parent, lins = _linears()
    params = [lin.weight for lin in lins]
    opt = torch.optim.SGD(params, lr=0.1)
    fuse(parent, "g", lins)
    assert all(lin.weight is p for lin, p in zip(lins, params))
    x = torch.randn(4, 16)
    before = fused_weight(parent, "g").clone()
    sum(lin(x).square().sum() for lin in lins).backward()
    assert all(p.grad is not None for p in params)
    opt.step()
    assert not torch.equal(fused_weight(parent, "g"), before), "the step went through the views"
    for got, lin in zip(project(parent, "g", lins, x), lins):
        assert_rel(got, lin(x), 1e-6, "after a step")


def test_fusing_under_inference_mode_leaves_ordinary_parameters():
    parent, lins = _linears()
    with torch.inference_mode():
        fuse(parent, "g", lins)
    assert not any(lin.weight.is_inference() for lin in lins) and lins[0].weight.requires_grad
    with torch.no_grad():
        lins[0].weight.mul_(2)  # would raise on an inference tensor
    lins[1].weight = nn.Parameter(torch.randn(8, 16))
    with torch.inference_mode():
        refresh(parent, "g", lins)
    assert not fused_weight(parent, "g").is_inference()


def test_hooked_or_wrapped_projections_are_unfused():
    parent, lins = _linears()
    fuse(parent, "g", lins)
    lins[1].register_forward_hook(lambda mod, args, out: out * 2)
    assert not refresh(parent, "g", lins) and fused_weight(parent, "g") is None
    assert len({lin.weight.untyped_storage().data_ptr() for lin in lins}) == 3, "each weight its own again"


def test_weights_swapped_within_a_group_are_copied_before_overwritten():
    parent, lins = _linears(sizes=(8, 8, 3))
    fuse(parent, "g", lins)
    x = torch.randn(2, 16)
    a, b = lins[0].weight, lins[1].weight
    want = [b.detach().clone(), a.detach().clone()]
    lins[0].weight, lins[1].weight = b, a
    refresh(parent, "g", lins)
    assert torch.equal(lins[0].weight, want[0]) and torch.equal(lins[1].weight, want[1])
    for got, lin in zip(project(parent, "g", lins, x), lins):
        assert_rel(got, lin(x), 1e-6, "after a swap")


@pytest.mark.parametrize("build", [qwen35_causal_lm, qwen3_next_causal_lm])
def test_generate_fuses_without_growing_the_model_and_disable_unfuses(build):
    model = hybridspec.enable(build())
    family = family_of(model)
    params = sum(p.numel() for p in model.parameters())
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = torch.arange(1, 9)[None]
    model.generate(prompt, assistant_model=tiny_drafter(), hybridspec=True, verify_length=4, max_new_tokens=4)
    fused = [fused_weight(parent, name) for parent, name, _ in groups(family, model)]
    assert all(w is not None for w in fused) and len(fused) > 0
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(w.untyped_storage().data_ptr() in storages for w in fused), "the fused weights are the parameters' storage"
    assert sum(p.numel() for p in model.parameters()) == params
    assert model.state_dict().keys() == reference.keys()
    hybridspec.disable(model)
    assert all(fused_weight(parent, name) is None for parent, name, _ in groups(family, model))
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())


def test_weights_replaced_between_calls_are_used():
    """A projection replaced after a hybridspec call (a new Parameter, not an in-place copy) is what
    the next call verifies with: its output equals the unpatched model's with the new weight."""
    model = hybridspec.enable(qwen35_causal_lm())
    drafter = tiny_drafter()
    prompt = torch.arange(1, 9)[None]
    model.generate(prompt, assistant_model=drafter, hybridspec=True, verify_length=4, max_new_tokens=MAX_NEW)
    family = family_of(model)
    mod = family.text_model(model).layers[0].linear_attn
    g = torch.Generator().manual_seed(5)
    mod.in_proj_z.weight = nn.Parameter(torch.randn(mod.in_proj_z.weight.shape, generator=g))
    attn = family.text_model(model).layers[3].self_attn
    attn.k_proj.weight = nn.Parameter(torch.randn(attn.k_proj.weight.shape, generator=g) * 0.2)
    expected = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)
    got = model.generate(prompt, assistant_model=drafter, hybridspec=True, verify_length=4, max_new_tokens=MAX_NEW,
                         do_sample=False)
    assert torch.equal(got, expected)
    assert fuse_model(family, model) and fused_weight(mod, "in") is not None
