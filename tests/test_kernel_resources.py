"""`benchmarks/kernel_resources.py` reads a compiled kernel's registers, spills and shared memory:
on the verify kernel's two forms, whose register needs differ by far (the one-row form has no
padded tiles and no tensor-core dots), and with the specialization a launch gives (alignment hints,
constant 1s), without which the figures are not the runner's."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from hybridspec.ops.dispatch import TRITON_INTERPRET  # noqa: E402

pytestmark = pytest.mark.skipif(TRITON_INTERPRET, reason="under the interpreter the kernels are not JIT functions")


def test_resources_of_the_verify_kernels_two_forms():
    from benchmarks.kernel_resources import resources, verify

    one_row, padded = resources(verify(True)), resources(verify(False))
    for r in (one_row, padded):
        assert 0 < r["registers"] <= 255 and r["spill_stack_bytes"] >= 0 and r["shared_bytes"] >= 0
    assert not one_row["tensor_cores"] and padded["tensor_cores"]
    assert one_row["registers"] < padded["registers"]


def test_the_compile_specializes_as_a_launch_does():
    """Pointers carry the 16-byte alignment hint a launch gives torch's allocations, so the experts'
    gate/up kernel pipelines its weight tiles through shared memory (without the hint it stages
    nothing and spills: the figures a compile without it reports are not the runner's); an integer
    argument of 1 becomes a constant, as Triton's launch makes it."""
    from benchmarks.kernel_resources import compile_sm90, moe, resources, small_linear
    from hybridspec.ops.linear_triton import small_linear_kernel

    gate_up = moe("gate_up")
    assert "async_copy_global_to_local" in gate_up.asm["ttgir"]
    assert resources(gate_up)["shared_bytes"] > 64 * 1024
    one, odd = small_linear(rows=1), small_linear(rows=3)
    # M is a kernel argument at 3 and folded into the code at 1
    assert len(one.asm["ptx"].split(".param")) < len(odd.asm["ptx"].split(".param"))
    with pytest.raises(ValueError, match="no integer arguments"):
        compile_sm90(small_linear_kernel, "bf16", {}, ints=dict(rows=1))
