"""`benchmarks/kernel_resources.py` reads a compiled kernel's registers, spills and shared memory:
on the verify kernel's two forms, whose register needs differ by far (the one-row form has no
padded tiles and no tensor-core dots)."""

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
