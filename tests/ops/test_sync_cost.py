"""`benchmarks/sync_cost.py`'s kernels: under the interpreter on one program (it runs programs one
after another, so spinning programs cannot meet across programs there), each leaving the end state
the GPU run checks and the edges adding one per launch; on a GPU (`gpu`), on every SM at once."""

from __future__ import annotations

import pytest
import torch

from hybridspec.ops.dispatch import TRITON_INTERPRET

interpreted = pytest.mark.skipif(not TRITON_INTERPRET, reason="the kernels run on the CPU under TRITON_INTERPRET=1 only")


@interpreted
def test_edges_add_one_per_launch():
    from benchmarks.sync_cost import edges

    buf = torch.tensor([5, -2, 0], dtype=torch.int32)
    edges(buf, 4, pdl=True)
    assert buf.tolist() == [9, 2, 4]


@interpreted
@pytest.mark.parametrize("n", [1, 7])
def test_one_program_passes_the_flag_n_times(n):
    from benchmarks.sync_cost import hops

    flag = torch.full((1,), 123, dtype=torch.int32)  # reset by the call
    err = torch.zeros(1, dtype=torch.int32)
    hops(flag, 1, n, err)
    assert flag.item() == n and err.item() == 0


@interpreted
@pytest.mark.parametrize("n", [1, 5])
def test_one_program_meets_itself_n_times(n):
    from benchmarks.sync_cost import barriers

    count = torch.full((1,), -4, dtype=torch.int32)
    err = torch.zeros(1, dtype=torch.int32)
    barriers(count, 1, n, err)
    assert count.item() == n and err.item() == 0


def test_it_refuses_to_run_without_cuda(monkeypatch):
    import sys

    from benchmarks import sync_cost

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["sync_cost.py"])
    with pytest.raises(SystemExit, match="CUDA is not available"):
        sync_cost.main()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or TRITON_INTERPRET, reason="needs CUDA, not interpreted")
def test_every_sm_passes_the_flag_and_meets_on_cuda():
    from benchmarks.sync_cost import barriers, hops

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flag, count, err = (torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(3))
    hops(flag, sms, 5 * sms + 3, err)
    barriers(count, sms, 9, err)
    torch.cuda.synchronize()
    assert flag.item() == 5 * sms + 3
    assert count.item() == 9 * sms
    assert err.item() == 0


def test_programs_that_cannot_all_be_resident_are_refused():
    from benchmarks.sync_cost import barriers, hops

    # on the CPU (interpreted or not) programs run one after another: a second one would wait forever
    with pytest.raises(ValueError, match="cannot all be resident"):
        hops(torch.zeros(1, dtype=torch.int32), 2, 5, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="use 1 to 1"):
        barriers(torch.zeros(1, dtype=torch.int32), 0, 5, torch.zeros(1, dtype=torch.int32))


@interpreted
def test_a_program_that_waits_in_vain_gives_up_and_says_so():
    # two programs under the interpreter: the first waits for the second, which has not run yet, so
    # it spins its budget out, raises the error flag and goes on; the host then stops the run
    from benchmarks.sync_cost import _barrier_kernel, _hop_kernel, check_waits

    count, err = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    _barrier_kernel[(2,)](count, err, 1, 50, num_warps=1)
    assert err.item() == 1 and count.item() == 2
    flag, err = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    _hop_kernel[(2,)](flag, err, 3, 50, num_warps=1)
    assert err.item() == 1
    with pytest.raises(SystemExit, match="gave up waiting"):
        check_waits(err, "the hop kernel")
