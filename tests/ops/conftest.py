import contextlib

import pytest
import torch

from hybridspec.ops.dispatch import TRITON_INTERPRET, launch_counts, use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _poisoned(fn):
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if out.dtype in _FLOATS and not out.requires_grad:
            out.fill_(float("nan"))
        return out

    return wrapper


@pytest.fixture(autouse=True)
def nan_empty(monkeypatch):
    """Fill every `torch.empty`/`empty_like`/`new_empty` result with NaN: an output a kernel forgets to write fails."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty))


def kernel_devices():
    """Devices on which the op bodies run the Triton kernels (so tests compare kernel with naive)."""
    devices = []
    if TRITON_INTERPRET:
        devices.append("cpu")
    devices.append(pytest.param("cuda", marks=pytest.mark.gpu))
    return devices


@pytest.fixture(params=kernel_devices())
def device(request):
    if request.param == "cpu" and not use_triton(torch.empty(0)):
        pytest.fail("TRITON_INTERPRET=1 is set but Triton is not importable")
    return request.param


@contextlib.contextmanager
def expect_launch(name: str, count: int = 1):
    """Assert that the block launched the Triton kernel `name` `count` times."""
    before = launch_counts[name]
    yield
    launched = launch_counts[name] - before
    assert launched == count, f"expected {count} launch(es) of {name}, saw {launched}"
