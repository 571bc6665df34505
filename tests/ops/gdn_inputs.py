"""Random GDN inputs for the op tests, with the regimes that break naive kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st


@dataclass(frozen=True)
class GDNCase:
    B: int
    T: int
    HK: int
    group: int
    K: int
    V: int
    dtype: torch.dtype
    decay: str
    gate: str
    seed: int

    @property
    def HV(self) -> int:
        return self.HK * self.group


def make_inputs(case: GDNCase, device: str):
    """`q, k, v, g, beta` in `case.dtype` (g, beta fp32) and an fp32 `state`, on `device`."""
    gen = torch.Generator().manual_seed(case.seed)
    B, T, HK, HV, K, V = case.B, case.T, case.HK, case.HV, case.K, case.V

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(B, T, HK, K), randn(B, T, HK, K)
    v = randn(B, T, HV, V)
    u = torch.rand(B, T, HV, generator=gen)
    g = {
        "near_zero": -1e-4 * u,
        "moderate": -3.0 * u,
        "strong": -60.0 + 1e-3 * u,
        "mixed": torch.where(u < 0.3, -60.0 * u / 0.3, -1e-3 * u),
    }[case.decay]
    w = torch.rand(B, T, HV, generator=gen)
    beta = {"random": w, "zero": torch.zeros_like(w), "one": torch.ones_like(w), "binary": (w < 0.5).float()}[case.gate]
    state = randn(B, HV, K, V)
    q, k, v = (x.to(case.dtype) for x in (q, k, v))
    return tuple(x.to(device) for x in (q, k, v, g, beta, state))


def gdn_cases(head_dims=(16, 32, 64), max_batch=2):
    return st.builds(
        GDNCase,
        B=st.integers(1, max_batch),
        T=st.integers(1, 16),
        HK=st.sampled_from([1, 2, 4]),
        group=st.sampled_from([1, 2, 4]),
        K=st.sampled_from(head_dims),
        V=st.sampled_from(head_dims),
        dtype=st.sampled_from([torch.float32, torch.bfloat16]),
        decay=st.sampled_from(["near_zero", "moderate", "strong", "mixed"]),
        gate=st.sampled_from(["random", "zero", "one", "binary"]),
        seed=st.integers(0, 2**31 - 1),
    )
