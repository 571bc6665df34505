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


@dataclass(frozen=True)
class ConvCase:
    """Inputs of `gdn_conv_verify`: the layer's pre-conv projection and gate inputs, its conv window
    and weights, the state. `a_scale` spreads `a + dt_bias` past softplus' threshold (20) at 30,
    where `exp(A_log)` is drawn 100x smaller (in [0.01, 0.16]) so that the decays stay within what
    test_gdn.py covers (a cumulative decay in the ten thousands costs the block form its fp32
    accuracy whatever computed g); `n` per batch row (None: every row counts; rows past it hold NaN)."""

    B: int
    T: int
    HK: int
    group: int
    K: int
    V: int
    dtype: torch.dtype
    bias: bool
    a_scale: float
    n: tuple[int, ...] | None
    seed: int
    KW: int = 4

    @property
    def HV(self) -> int:
        return self.HK * self.group

    @property
    def C(self) -> int:
        return 2 * self.HK * self.K + self.HV * self.V


# `gdn_conv_verify`'s positional arguments, in order
CONV_ARGS = ("mixed", "window", "conv_weight", "conv_bias", "a", "b", "A_log", "dt_bias", "state")


def make_conv_inputs(case: ConvCase, device: str) -> dict:
    """`gdn_conv_verify`'s arguments by name (`CONV_ARGS` and `num_tokens`). `mixed`, `b` and `a`
    are slices of one projection output `[B, T, C + 2 HV + 3]` (row strides past their widths, as
    the fused GEMM's), rows past `n` NaN; the conv weights, `A_log` and `dt_bias` in the case's
    dtype, the state fp32."""
    gen = torch.Generator().manual_seed(case.seed)
    B, T, HV, C = case.B, case.T, case.HV, case.C

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(case.dtype)

    out = randn(B, T, C + 2 * HV + 3)
    out[..., C + HV : C + 2 * HV] *= case.a_scale
    nt = None
    if case.n is not None:
        nt = torch.tensor(case.n)
        past = torch.arange(T)[None, :] >= nt[:, None]
        out = torch.where(past[..., None], torch.full_like(out, float("nan")), out)
    # moved before slicing: a copy to another device would not keep the slices' strides
    out = out.to(device)
    args = dict(
        mixed=out[..., :C], window=randn(B, C, case.KW), conv_weight=randn(C, case.KW, scale=0.5),
        conv_bias=randn(C, scale=0.3) if case.bias else None, a=out[..., C + HV : C + 2 * HV], b=out[..., C : C + HV],
        A_log=torch.log((torch.rand(HV, generator=gen) * 15 + 1) * (0.01 if case.a_scale > 20 else 1.0)).to(case.dtype),
        dt_bias=randn(HV),
        state=torch.randn(B, HV, case.K, case.V, generator=gen), num_tokens=nt,
    )
    return {k: v if v is None else v.to(device) for k, v in args.items()}


def conv_cases(head_dims=(16, 32), max_batch=2):
    @st.composite
    def build(draw):
        B, T = draw(st.integers(1, max_batch)), draw(st.integers(1, 16))
        n = draw(st.one_of(st.none(), st.lists(st.integers(0, T), min_size=B, max_size=B).map(tuple)))
        return ConvCase(
            B=B, T=T, HK=draw(st.sampled_from([1, 2])), group=draw(st.sampled_from([1, 2])),
            K=draw(st.sampled_from(head_dims)), V=draw(st.sampled_from(head_dims)),
            dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), bias=draw(st.booleans()),
            a_scale=draw(st.sampled_from([1.0, 30.0])), n=n, seed=draw(st.integers(0, 2**31 - 1)),
        )

    return build()
