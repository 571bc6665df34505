"""The compiled layers' inductor options (`hybridspec.ops.dispatch.layer_options`): inductor's PDL
only where ours is on, settings this torch does not know left out, and the compiled blocks keyed
on the options they were compiled with."""

from __future__ import annotations

import pytest
import torch

from hybridspec import cache
from hybridspec.ops import dispatch


def test_pdl_off_leaves_inductor_pdl_out_too(monkeypatch):
    monkeypatch.setattr(dispatch, "LAYER_OPTIONS", {"combo_kernels": True, "triton.enable_pdl": True})
    monkeypatch.setattr(dispatch, "PDL", True)
    assert dispatch.layer_options() == {"combo_kernels": True, "triton.enable_pdl": True}
    monkeypatch.setattr(dispatch, "PDL", False)
    assert dispatch.layer_options() == {"combo_kernels": True}


def test_unknown_settings_are_left_out(monkeypatch):
    monkeypatch.setattr(dispatch, "LAYER_OPTIONS", {"combo_kernels": True, "not_an_inductor_setting": 1})
    assert dispatch.layer_options() == {"combo_kernels": True}


def test_no_pdl_off_cuda_or_under_the_interpreter():
    assert not dispatch.use_pdl(torch.zeros(1))
    assert dispatch.pdl_launch(False) == {} and dispatch.pdl_launch(True) == {"launch_pdl": True}


@pytest.mark.parametrize("options", [{}, {"combo_kernels": True}])
def test_compiled_blocks_are_kept_per_options(options, monkeypatch):
    from typing import NamedTuple

    monkeypatch.setattr(cache, "_COMPILED_BLOCKS", cache.BoundedCache(4))

    def double(x):
        return 2 * x

    class Blocks(NamedTuple):
        f: object = double

    first = cache.compiled_once(Blocks, options)
    assert cache.compiled_once(Blocks, dict(options)) is first
    assert cache.compiled_once(Blocks, {**options, "max_autotune": False}) is not first
    assert torch.equal(first.f(torch.ones(2)), torch.full((2,), 2.0))
