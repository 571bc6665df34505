"""Weights asked into L2 by a kernel that leaves DRAM idle, for a kernel after it.

A decode step alternates kernels that stream weights (projections, experts) with kernels bound by
latency, not bytes: the GDN verify kernel reads a 2 MB state, decode attention a short context.
While those run, DRAM has time for the next weights. A kernel given `NUM_PF > 0` regions asks L2
for this program's share of each as its first act, before its PDL wait: a weight is written by no
kernel of a step, so reading it early is safe at any point (hybridspec/ops/pdl_triton.py). Nothing
is loaded into registers or read back, so the kernel's own results cannot change; the consumer
then finds its weight in L2 (docs/design.md, "Weights prefetched into L2").

`MODE` 1: one `cp.async.bulk.prefetch.L2` (sm90) per thread of its piece; 2: one
`prefetch.global.L2` per 128-byte line. Pieces are multiples of 16 bytes, the bulk form's rule; a
region's last bytes past a multiple of 16 are not asked for.
"""

from __future__ import annotations

import triton
import triton.language as tl

LINE = tl.constexpr(128)


@triton.jit
def _region(ptr, nbytes, share, shares, THREADS: tl.constexpr, MODE: tl.constexpr):
    """This program's share of `nbytes` bytes at `ptr`, cut into THREADS pieces of 16-byte multiples."""
    base = ptr.to(tl.pointer_type(tl.int8))
    total = nbytes.to(tl.int64)
    piece = tl.cdiv(tl.cdiv(total, shares * THREADS), 16) * 16
    idx = share.to(tl.int64) * THREADS + tl.arange(0, THREADS)
    off = idx * piece
    size = (tl.minimum(tl.maximum(total - off, 0), piece) // 16 * 16).to(tl.int32)
    if MODE == 1:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        lines = tl.cdiv(piece, LINE)
        for j in range(0, lines):
            at = j * LINE
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.lt.s32 p, $2, $3; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                "=r,l,r,r", [base + off + at, tl.zeros_like(size) + at.to(tl.int32), size], dtype=tl.int32,
                is_pure=False, pack=1)


@triton.jit
def prefetch_weights(pf0_ptr, pf0_bytes, pf1_ptr, pf1_bytes, pf2_ptr, pf2_bytes,
                     NUM_PF: tl.constexpr, THREADS: tl.constexpr, MODE: tl.constexpr):
    """Ask L2 for this program's share of up to three regions (the grid's programs split each)."""
    if NUM_PF > 0:
        share = (tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2)))
        shares = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        _region(pf0_ptr, pf0_bytes, share, shares, THREADS, MODE)
        if NUM_PF > 1:
            _region(pf1_ptr, pf1_bytes, share, shares, THREADS, MODE)
        if NUM_PF > 2:
            _region(pf2_ptr, pf2_bytes, share, shares, THREADS, MODE)
