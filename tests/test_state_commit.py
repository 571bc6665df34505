"""`commit_buffers`' conv windows and lengths against the window read off the concatenation
[window, inputs], per row and accepted length (its GDN part is `gdn_commit`'s, tested in tests/ops)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridspec.ops import GDNFactors
from hybridspec.state import commit_buffers


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 4), w=st.integers(1, 16), k=st.integers(2, 4), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_conv_windows_and_lengths_move_by_each_rows_m(B, w, k, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    Lg, HV, HK, K, V, C, W = 2, 2, 1, 16, 16, 6, 16
    windows = torch.randn(Lg, B, C, k, generator=g).to(dtype)
    inputs = torch.randn(Lg, B, C, W, generator=g).to(dtype)
    m = torch.randint(0, w + 1, (B,), generator=g)
    length = torch.randint(0, 100, (B,), generator=g)
    states = torch.randn(Lg, B, HV, K, V, generator=g)
    factors = GDNFactors(torch.randn(Lg, B, w, HV, V, generator=g), torch.randn(Lg, B, w, HK, K, generator=g),
                         torch.randn(Lg, B, w, HV, generator=g))
    full = torch.cat([windows, inputs[..., :w]], dim=-1)
    want = torch.stack([full[:, b, :, int(m[b]):int(m[b]) + k] for b in range(B)], dim=1)
    want_length = length + m
    commit_buffers(states, factors, windows, inputs, length, m)
    assert torch.equal(windows, want)
    assert torch.equal(length, want_length)
