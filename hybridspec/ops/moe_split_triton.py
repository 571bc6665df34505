"""The MoE experts of a few rows in one launch: each program owns a slice of the experts' width I.

Why: at a decode step (1..4 rows) the experts op's gate/up and down kernels are two dependent
launches, and the down kernel cannot start reading until gate/up has finished: on an H200 the pair
takes ~25 us a layer for ~57 MB of weights that a single read streams in ~17 us. Splitting I
removes the dependency. SwiGLU is elementwise along I, so a program that owns columns
[b * BI, (b + 1) * BI) of I computes those columns of `silu(gate) * up` from its own gate and up
rows, and multiplies them by the same columns of the down projection: a partial sum over I of
the expert's output, `[rows, H]`. The NB = I / BI partials of an assignment are added by the
consumer (`moe_combine`, in the compiled residual add), in the order b = 0..NB-1.

`moe_split_kernel`, grid (slots, NB), slots as in hybridspec/ops/moe_triton.py (one leading slot
per selected expert, the shared expert as slot T * K): the leading program multiplies every row
that chose its expert (others masked to zero, padded to BM rows for tl.dot) by its `[BI, H]`
gate and up tiles, rounds the SwiGLU output to the weight dtype (as the two-kernel op does), then
walks H in BH steps of the down projection's `[BH, BI]` tile and stores each step into split b of
every (row, j) that chose the expert in `y` `[T, KY, NB, H]` (fp32). Every slot of `y` is written:
zeros where no expert is (invalid assignments, the shared slot past the counted rows). No atomics,
so a result is the same on every run. The cost: `y` is T * KY * NB * H fp32 values (1.2 MB at one
row of the 35B-A3B shape), written here and read by the consumer, which is why the op serves a few
rows only (`MoEKernelConfig.split_max_rows`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.moe_triton import _round_bf16, _slot_leader
from hybridspec.ops.pdl_triton import pdl_enter


@triton.jit
def moe_split_kernel(
    x_ptr, ids_ptr, num_tokens_ptr, w_ptr, sw_ptr, d_ptr, sd_ptr, y_ptr,
    T, E, s_xt,
    H: tl.constexpr, I: tl.constexpr, K: tl.constexpr, NB: tl.constexpr,
    BM: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr, HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    slot = tl.program_id(0)
    b = tl.program_id(1)
    BI: tl.constexpr = I // NB
    # y's assignments per row: k, and the shared expert's after them
    KY: tl.constexpr = K + 1 if HAS_SHARED else K
    n, e, lead, shared, valid = _slot_leader(ids_ptr, num_tokens_ptr, slot, T, E, 0, K, SP, HAS_NUM_TOKENS,
                                             HAS_SHARED)
    rows = tl.arange(0, BM)
    # the scalar as a row vector: the interpreter turns a scalar & vector mask into int32
    shared_rows = (rows * 0 + shared.to(tl.int32)) > 0  # [BM]
    if lead:
        cols = tl.arange(0, KP)
        ids2 = tl.load(ids_ptr + rows[:, None] * K + cols[None, :],
                       mask=(rows[:, None] < T) & (cols[None, :] < K), other=-1)
        # bit j of jbits[r]: routed assignment (r, j) chose this expert (never on the shared slot,
        # whose e is E: an out-of-range id E in a counted row must not match it)
        chose2 = (ids2 == e) & (rows[:, None] < n) & ~shared_rows[:, None]  # [BM, KP]
        jbits = tl.sum(chose2.to(tl.int32) << cols[None, :], axis=1)  # [BM]
        # rows loaded: those that chose e (every counted row on the shared slot); the others
        # (padding, NaN rows past n) stay zero
        member = (rows < n) & ((jbits != 0) | shared_rows)
        cols_i = b * BI + tl.arange(0, BI)  # this program's columns of I
        # gate_up_proj[e] is [2I, H] (gate rows, then up rows), down_proj[e] is [H, I]
        w_base = w_ptr + e.to(tl.int64) * (2 * I * H)
        d_base = d_ptr + e.to(tl.int64) * (H * I)
        if HAS_SHARED:
            if shared:
                w_base = sw_ptr
                d_base = sd_ptr
        acc_g = tl.zeros([BM, BI], dtype=tl.float32)
        acc_u = tl.zeros([BM, BI], dtype=tl.float32)
        for k0 in range(0, H, BK):
            cols_k = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rows[:, None] * s_xt + cols_k[None, :], mask=member[:, None], other=0.0)
            wg = tl.load(w_base + cols_i[:, None] * H + cols_k[None, :])  # [BI, BK]
            wu = tl.load(w_base + (I + cols_i[:, None]) * H + cols_k[None, :])  # [BI, BK]
            # the interpreter multiplies bf16 bit patterns as integers: upcast there (exact products)
            if INTERPRET_BF16:
                x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PRECISION)
        # SwiGLU, rounded to the weight dtype before the down projection (as the two-kernel op)
        act = acc_g * tl.sigmoid(acc_g) * acc_u  # [BM, BI]
        if INTERPRET_BF16:
            a = _round_bf16(act)
        else:
            a = act.to(d_ptr.dtype.element_ty)
        for c in range(0, H, BH):
            cols_h = c + tl.arange(0, BH)
            wd = tl.load(d_base + cols_h[:, None] * I + cols_i[None, :])  # [BH, BI]
            if INTERPRET_BF16:
                wd = wd.to(tl.float32)
            part = tl.dot(a, tl.trans(wd), input_precision=PRECISION)  # [BM, BH]
            # each (row, j) that chose e gets its own copy, so a row naming e twice is counted twice
            for j in tl.static_range(K):
                pick = ((jbits >> j) & 1) != 0
                tl.store(y_ptr + ((rows[:, None] * KY + j) * NB + b) * H + cols_h[None, :], part, mask=pick[:, None])
            if HAS_SHARED:
                # rows n..T-1 as well: their inputs were masked to zero, so their output is zero
                tl.store(y_ptr + ((rows[:, None] * KY + K) * NB + b) * H + cols_h[None, :], part,
                         mask=((rows < T) & shared_rows)[:, None])
    # every slot of y defined: zeros where no expert program writes, an invalid routed assignment
    # (its row past n, its id outside [0, E)) or the shared slot of a call with no counted row
    if (slot < T * K) & ~valid:
        for c in range(0, H, BH):
            tl.store(y_ptr + (((slot // K) * KY + slot % K) * NB + b) * H + c + tl.arange(0, BH),
                     tl.zeros([BH], dtype=tl.float32))
    if HAS_SHARED:
        if shared & ~lead:
            for c in range(0, H, BH):
                cols_h = c + tl.arange(0, BH)
                tl.store(y_ptr + ((rows[:, None] * KY + K) * NB + b) * H + cols_h[None, :],
                         tl.zeros([BM, BH], dtype=tl.float32), mask=(rows < T)[:, None])
