"""Lifecycle: `disable` frees the runner; process-wide caches are bounded objects."""

from __future__ import annotations

import pytest
import torch

import hybridspec
from hybridspec.cache import BoundedCache
from hybridspec.tiny import tiny_drafter, tiny_target


def test_disable_leaves_no_runner_attribute():
    model, drafter = hybridspec.enable(tiny_target()), tiny_drafter()
    prompt = torch.arange(1, 9)[None]
    model.generate(prompt, assistant_model=drafter, hybridspec=True, verify_length=4, max_new_tokens=6)
    assert "_hybridspec_runner" in model.__dict__, "a DFlash drafter on the CPU runs on the (eager) runner"
    hybridspec.disable(model)
    assert not any(name.startswith("_hybridspec") for name in model.__dict__), list(model.__dict__)


def test_bounded_cache_drops_the_least_recently_used_entry():
    cache, built = BoundedCache(2), []

    def build(key):
        built.append(key)
        return key * 10

    assert [cache.get(k, lambda k=k: build(k)) for k in (1, 2, 1, 3)] == [10, 20, 10, 30]
    assert len(cache) == 2 and built == [1, 2, 3]
    cache.get(2, lambda: build(2))
    assert built == [1, 2, 3, 2], "2 was least recently used when 3 arrived, so it was dropped"
    assert cache.first_time("w") and not cache.first_time("w")
    with pytest.raises(ValueError, match="maxsize must be positive"):
        BoundedCache(0)
