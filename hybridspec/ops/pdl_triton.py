"""Programmatic dependent launch (PDL, sm90+): the one rule every kernel of ours follows.

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream still
runs, so its launch and block scheduling overlap that kernel's tail (inside a captured graph each
of the step's ~500 launches otherwise pays that gap). Every program of such a kernel calls
`pdl_enter` first: it waits (`gdc_wait`) until the previous kernel has finished and its writes are
visible, and only then lets the next kernel launch (`gdc_launch_dependents`). Waiting before any
load or store keeps each kernel's reads and writes where stream order put them; signalling only
after the wait means a kernel that has started implies every kernel two or more places before it
has finished, which inductor's PDL kernels (they, too, wait before they signal) rely on as well.
With `USE_PDL` false (older GPUs, the interpreter, `HYBRIDSPEC_PDL=0`) the branch compiles away.
(An L2 prefetch of `small_linear`'s weight before the wait was timed on the H200 and removed: the
AR step did not change, docs/benchmarks.md, "The fused head on by default".)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
