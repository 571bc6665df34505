"""The MoE benchmark's read floor (benchmarks/read_floor.py) reads exactly the selected experts."""

import pytest
import torch

from benchmarks.read_floor import read_experts


def test_chunk_sums_cover_the_selected_experts(device):
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(6, 64, 32, generator=gen).to(torch.bfloat16).to(device)
    down = torch.randn(6, 32, 32, generator=gen).to(torch.bfloat16).to(device)
    experts = torch.tensor([4, 1, 5], device=device)
    sums = read_experts(gate_up, down, experts, (512, 256, 4)).cpu()
    # [U, chunks]: gate_up[e] is 4 chunks of 512 elements, down[e] 2
    assert sums.shape == (3, 6)
    for u, e in enumerate(experts.tolist()):
        want_gu = gate_up[e].float().cpu().reshape(4, 512).sum(1)
        want_dn = down[e].float().cpu().reshape(2, 512).sum(1)
        torch.testing.assert_close(sums[u], torch.cat([want_gu, want_dn]), rtol=1e-5, atol=1e-4)


def test_chunk_must_divide_the_expert_blocks():
    gate_up, down = torch.zeros(2, 64, 32), torch.zeros(2, 32, 32)
    with pytest.raises(ValueError, match="chunk 768 must divide"):
        read_experts(gate_up, down, torch.tensor([0]), (768, 256, 4))
