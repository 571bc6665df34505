"""`benchmarks/sync_cost.py`'s kernels under the interpreter, on one program (the interpreter runs
programs one after another, so the spinning ones cannot meet across programs there): each leaves
the end state the GPU run checks, and the edges add one per launch."""

from __future__ import annotations

import pytest
import torch

from hybridspec.ops.dispatch import TRITON_INTERPRET

pytestmark = pytest.mark.skipif(not TRITON_INTERPRET, reason="the kernels run on the CPU under TRITON_INTERPRET=1 only")


def test_edges_add_one_per_launch():
    from benchmarks.sync_cost import edges

    buf = torch.tensor([5, -2, 0], dtype=torch.int32)
    edges(buf, 4, pdl=True)
    assert buf.tolist() == [9, 2, 4]


@pytest.mark.parametrize("n", [1, 7])
def test_one_program_passes_the_flag_n_times(n):
    from benchmarks.sync_cost import hops

    flag = torch.full((1,), 123, dtype=torch.int32)  # reset by the call
    hops(flag, 1, n)
    assert flag.item() == n


@pytest.mark.parametrize("n", [1, 5])
def test_one_program_meets_itself_n_times(n):
    from benchmarks.sync_cost import barriers

    count = torch.full((1,), -4, dtype=torch.int32)
    barriers(count, 1, n)
    assert count.item() == n


def test_it_refuses_to_run_without_cuda(monkeypatch):
    import sys

    from benchmarks import sync_cost

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["sync_cost.py"])
    with pytest.raises(SystemExit, match="CUDA is not available"):
        sync_cost.main()
