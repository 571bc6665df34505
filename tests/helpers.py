"""Comparison and call-counting helpers shared by the tests."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error; NaN or inf anywhere gives inf. Reference norms below 1e-20 count as 1e-20."""
    actual, expected = actual.double(), expected.double()
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return float("inf")
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-20)).item()


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def count_top1(monkeypatch) -> list:
    """A list that gets one entry per `stages.top1` call (a round or step taking the fused head;
    in a captured step, at capture)."""
    from hybridspec.round import stages

    calls = []
    top1 = stages.top1
    monkeypatch.setattr(stages, "top1", lambda target, hidden: calls.append(hidden.shape) or top1(target, hidden))
    return calls
