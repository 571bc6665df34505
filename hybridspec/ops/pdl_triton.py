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

The one thing a kernel may touch before `pdl_enter` is memory no kernel of the step writes: a
weight. `prefetch_l2` asks for its cache lines in L2 (no registers held, nothing read back), so a
weight-streaming kernel starts pulling its weight while the kernel before it finishes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptrs):
    """`prefetch.global.L2` of every address in `ptrs` (one per 128-byte line is enough); the
    addresses must be valid. Returns zeros (inline asm needs an output)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
