"""2,000 rounds of verify + commit with random lengths track the recurrence over the committed tokens."""

import pytest
import torch

from hybridspec.ops import GDNFactors, gdn_commit, gdn_verify, naive
from hybridspec.ops.dispatch import TRITON_INTERPRET
from tests.helpers import rel_err

ROUNDS = 2000
TOL = 1e-4


def _run(device, HK, HV, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(1, 1, HV, K, V, generator=gen).to(device)  # [L=1, B=1, HV, K, V]
    ref = state[0].cpu().clone()
    worst_o = 0.0
    for r in range(ROUNDS):
        w = int(torch.randint(1, 17, (1,), generator=gen))
        m = int(torch.randint(1, w + 1, (1,), generator=gen))
        # half the rounds pad to T = 16 with garbage and pass the length on the device, as a graph does
        T = 16 if r % 2 else w
        q, k = torch.randn(2, 1, T, HK, K, generator=gen)
        v = torch.randn(1, T, HV, V, generator=gen)
        g = -torch.rand(1, T, HV, generator=gen) * torch.rand(1, generator=gen) * 4
        beta = torch.rand(1, T, HV, generator=gen)
        nt = torch.tensor([w], device=device) if T != w else None
        o, f = gdn_verify(*(x.to(device) for x in (q, k, v, g, beta)), state[0], num_tokens=nt)
        gdn_commit(state, GDNFactors(*(x[None] for x in f)), torch.tensor([m], device=device))
        ref_o, _, _, _, ref_states = naive.recurrent_states(*(x[:, :w] for x in (q, k, v, g, beta)), ref)
        worst_o = max(worst_o, rel_err(o[:, :w].cpu(), ref_o))
        ref = ref_states[:, m - 1]
    assert worst_o <= TOL, f"worst per-round output error {worst_o:.2e}"
    err = rel_err(state[0].cpu(), ref)
    assert err <= TOL, f"state after {ROUNDS} rounds: relative error {err:.2e}"


# The interpreter costs ~60 ms a round, so the CPU run uses one small head; the GPU the Qwen3.6 shape.
SHAPES = [pytest.param("cuda", (16, 32, 128, 128), marks=pytest.mark.gpu, id="cuda-qwen36")]
if TRITON_INTERPRET:
    SHAPES.insert(0, pytest.param("cpu", (1, 1, 16, 16), id="cpu-small"))


@pytest.mark.parametrize("device,shape", SHAPES)
def test_long_horizon(device, shape):
    _run(device, *shape)
