"""Small-batch MoE experts (SwiGLU) whose cost follows the distinct experts touched.

Up to BM token rows (16, or up to 64 for a batch of verification windows) with k assignments each. The grid's first axis runs over the T * k
assignment *slots* (slot s = row * k + j). A slot *leads* when its assignment is valid (row below
`num_tokens`, expert id in [0, E)) and no earlier valid slot chose the same expert; every other
slot's program exits at once. So each selected expert is handled by exactly one slot, and its
weights are read once per call however many rows chose it, without sorting or host syncs.

1. `moe_gate_up_kernel`, grid (slots, I / BN): the leading program of expert e multiplies all rows
   that chose e (others masked to zero, padded to BM rows for tl.dot) by its BN-row tiles of the
   gate and up projections and stores `silu(gate) * up` `[BM, BN]` into expert e's rows of `h`.
2. `moe_down_kernel`, grid (slots, H / BN): the leading program multiplies `h[e]` `[BM, I]` by a
   BN-row tile of the down projection and stores the result for every (row, j) that chose e into
   the per-assignment buffer `y` `[BM, k, H]` (fp32).
3. `moe_reduce_kernel`, grid (T, H / BN): `out[r] = sum_j w[r, j] * y[r, j]` over valid
   assignments, in the fixed order j = 0..k-1 (deterministic, no atomics), cast to the output dtype.

`hybridspec::moe_experts_partials` launches the first two alone and returns `y` itself, its
consumer adding it (`moe_combine`, plain torch that inductor fuses into the residual add after the
block: one launch a layer less). There the down kernel runs with WRITE_ALL: the programs of slots
no expert program writes (invalid assignments, the shared slot of a piece with no counted row)
store zeros, so every slot of `y` is defined.

With HAS_SHARED the block's shared expert runs as one more slot, slot T * k, chosen by every counted
row: its gate/up and down programs read the shared weights (`[2I, H]`, `[H, I]`, expert index E of
`h`) and store into the extra assignment k of `y` `[BM, k + 1, H]`; the reduce kernel then adds
`round(round(sigmoid(gate)) * round(shared))` to the routed sum rounded to the output dtype and
rounds again: the block-level roundings of transformers' sparse MoE block. One launch per stage for the
routed and shared experts together, instead of the shared expert's own GEMMs and elementwise work.

With USE_PDL (programmatic dependent launch, sm90+) each kernel may launch while the one before it
runs, and waits for it first thing (`pdl_enter`, hybridspec/ops/pdl_triton.py).

Block sizes divide H and I (the host picks them), so no load along a weight row is masked and the
loads vectorise. Accumulation is fp32; the SwiGLU output is rounded to the weight dtype before the
down projection so 16-bit weights go to the tensor cores directly (transformers rounds it too).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridspec.ops.pdl_triton import pdl_enter


@triton.jit
def _round_bf16(x):
    """fp32 rounded to the nearest-even bf16 value, still fp32. Only for the interpreter, whose
    fp32 -> bf16 cast truncates; the GPU cast rounds to nearest even already. int64 math: the
    interpreter checks int32 arithmetic for overflow."""
    b = x.to(tl.int32, bitcast=True).to(tl.int64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _round_to(x, dtype: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """fp32 `x` rounded to `dtype` and back (a rounding step of the reference's 16-bit ops)."""
    if INTERPRET_BF16:
        return _round_bf16(x)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _slot_leader(ids_ptr, num_tokens_ptr, slot, T, E, row_off,
                 K: tl.constexpr, SP: tl.constexpr, HAS_NUM_TOKENS: tl.constexpr, HAS_SHARED: tl.constexpr):
    """Valid rows `n` of this piece, the expert `e` of assignment `slot`, whether `slot` is the
    first valid assignment to choose `e` (the one program per expert that does its work), whether
    it is the shared expert's slot T * K (then `e` = E, its index in `h`), and whether it is a
    valid routed assignment (its row below `n`, `e` in [0, E)), leading or not."""
    n = T
    if HAS_NUM_TOKENS:
        n = tl.minimum(tl.load(num_tokens_ptr).to(tl.int32) - row_off, T)
    # ids [T, K] contiguous, read flat; rows past n may hold garbage ids and never select
    f = tl.arange(0, SP)
    ids = tl.load(ids_ptr + f, mask=f < T * K, other=-1)
    e = tl.load(ids_ptr + slot, mask=slot < T * K, other=E)
    valid = (slot // K < n) & (e >= 0) & (e < E)
    earlier = (f < slot) & (f // K < n) & (ids == e)
    lead = valid & (tl.sum(earlier.to(tl.int32)) == 0)
    shared = slot == T * K
    if HAS_SHARED:
        lead = lead | (shared & (n > 0))
    return n, e, lead, shared, valid


@triton.jit
def _down_tile(h_ptr, w_ptr, sw_ptr, e, shared, rows, cols_n,
               H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """`h[e] @ down_e[cols_n].T` `[BM, BN]` in fp32 (`down_e` the shared weight `[H, I]` on the
    shared expert's slot, else expert e's rows of `down_proj` `[E, H, I]`)."""
    w_base = w_ptr + e.to(tl.int64) * (H * I)
    if HAS_SHARED:
        if shared:
            w_base = sw_ptr
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        cols_k = k0 + tl.arange(0, BK)
        h = tl.load(h_ptr + (e.to(tl.int64) * BM + rows[:, None]) * I + cols_k[None, :])  # [BM, BK]
        w = tl.load(w_base + cols_n[:, None] * I + cols_k[None, :])  # [BN, BK]
        if INTERPRET_BF16:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def moe_gate_up_kernel(
    x_ptr, ids_ptr, num_tokens_ptr, w_ptr, sw_ptr, h_ptr,
    T, E, row_off, s_xt,
    H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr, HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    slot = tl.program_id(0)
    i_n = tl.program_id(1)
    n, e, lead, shared, _ = _slot_leader(ids_ptr, num_tokens_ptr, slot, T, E, row_off, K, SP, HAS_NUM_TOKENS,
                                         HAS_SHARED)
    if lead:
        rows = tl.arange(0, BM)
        cols = tl.arange(0, KP)
        ids2 = tl.load(ids_ptr + rows[:, None] * K + cols[None, :],
                       mask=(rows[:, None] < T) & (cols[None, :] < K), other=-1)
        # a row is loaded only if it chose e (every counted row chose the shared expert); others
        # (padding, NaN rows past n) stay zero
        hits = tl.max((ids2 == e).to(tl.int32), axis=1) + shared.to(tl.int32)  # [BM]
        member = (rows < n) & (hits > 0)  # [BM]
        # this program's columns of I
        cols_n = i_n * BN + tl.arange(0, BN)  # [BN]
        # gate_up_proj[e] is [2I, H]: gate rows 0..I-1, up rows I..2I-1 (transformers' chunk order)
        w_base = w_ptr + e.to(tl.int64) * (2 * I * H)
        if HAS_SHARED:
            if shared:
                w_base = sw_ptr
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            cols_k = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rows[:, None] * s_xt + cols_k[None, :], mask=member[:, None], other=0.0)
            wg = tl.load(w_base + cols_n[:, None] * H + cols_k[None, :])  # [BN, BK]
            wu = tl.load(w_base + (I + cols_n[:, None]) * H + cols_k[None, :])  # [BN, BK]
            # the interpreter multiplies bf16 bit patterns as integers: upcast there (exact products)
            if INTERPRET_BF16:
                x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PRECISION)
        # SwiGLU
        act = acc_g * tl.sigmoid(acc_g) * acc_u  # [BM, BN]
        if INTERPRET_BF16:
            act = _round_bf16(act)
        tl.store(h_ptr + (e.to(tl.int64) * BM + rows[:, None]) * I + cols_n[None, :], act.to(h_ptr.dtype.element_ty))


@triton.jit
def moe_down_kernel(
    h_ptr, ids_ptr, num_tokens_ptr, w_ptr, sw_ptr, y_ptr,
    T, E, row_off,
    H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr, HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr, WRITE_ALL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    slot = tl.program_id(0)
    i_n = tl.program_id(1)
    # y's assignments per row: k, and the shared expert's after them
    KY: tl.constexpr = K + 1 if HAS_SHARED else K
    n, e, lead, shared, valid = _slot_leader(ids_ptr, num_tokens_ptr, slot, T, E, row_off, K, SP, HAS_NUM_TOKENS,
                                             HAS_SHARED)
    rows = tl.arange(0, BM)
    # this program's columns of H; down_proj[e] is [H, I]
    cols_n = i_n * BN + tl.arange(0, BN)  # [BN]
    if lead:
        # the scalar as a row vector: the interpreter turns a scalar & vector mask into int32
        shared_rows = (rows * 0 + shared.to(tl.int32)) > 0  # [BM]
        acc = _down_tile(h_ptr, w_ptr, sw_ptr, e, shared, rows, cols_n, H, I, BM, BN, BK, HAS_SHARED, PRECISION,
                         INTERPRET_BF16)
        # each (row, j) that chose e gets its own copy, so a row naming e twice is counted twice
        for j in tl.static_range(K):
            e_j = tl.load(ids_ptr + rows * K + j, mask=rows < T, other=-1)
            chose = (rows < n) & (e_j == e) & ~shared_rows
            tl.store(y_ptr + (rows[:, None] * KY + j) * H + cols_n[None, :], acc, mask=chose[:, None])
        if HAS_SHARED:
            # WRITE_ALL: rows n..T-1 as well; their inputs were masked to zero, so their output is zero
            limit = T if WRITE_ALL else n
            tl.store(y_ptr + (rows[:, None] * KY + K) * H + cols_n[None, :], acc,
                     mask=((rows < limit) & shared_rows)[:, None])
    if WRITE_ALL:
        # every slot of y defined (the partials op's consumer reads y whole): zeros where no expert
        # program writes, an invalid routed assignment (its row past n, its id outside [0, E)) or
        # the shared expert's slot of a piece with no counted row; duplicates get their leader's copy
        if (slot < T * K) & ~valid:
            tl.store(y_ptr + ((slot // K) * KY + slot % K) * H + cols_n, tl.zeros([BN], dtype=tl.float32))
        if HAS_SHARED:
            if shared & ~lead:
                tl.store(y_ptr + (rows[:, None] * KY + K) * H + cols_n[None, :], tl.zeros([BM, BN], dtype=tl.float32),
                         mask=(rows < T)[:, None])


@triton.jit
def moe_reduce_kernel(
    y_ptr, ids_ptr, wt_ptr, num_tokens_ptr, gate_ptr, out_ptr,
    T, E, row_off, s_wt, s_wk, s_gt, s_ot,
    H: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, HAS_NUM_TOKENS: tl.constexpr,
    HAS_SHARED: tl.constexpr, INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    r = tl.program_id(0)
    KY: tl.constexpr = K + 1 if HAS_SHARED else K
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    n = T
    if HAS_NUM_TOKENS:
        n = tl.minimum(tl.load(num_tokens_ptr).to(tl.int32) - row_off, T)
    acc = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(K):
        e = tl.load(ids_ptr + r * K + j)
        ok = (r < n) & (e >= 0) & (e < E)
        w = tl.load(wt_ptr + r * s_wt + j * s_wk).to(tl.float32)
        # y's unwritten slots (and NaN weights past n) are dropped by where, not by a multiply
        y = tl.load(y_ptr + (r * KY + j) * H + cols)
        acc += tl.where(ok, w * y, 0.0)
    dt: tl.constexpr = out_ptr.dtype.element_ty
    if HAS_SHARED:
        # transformers' block in the weights' dtype: routed sum, shared output, sigmoid gate, their
        # product and the sum each rounded; rows past n (NaN gates there) stay zero
        shared = _round_to(tl.load(y_ptr + (r * KY + K) * H + cols), dt, INTERPRET_BF16)
        gate = _round_to(tl.sigmoid(tl.load(gate_ptr + r * s_gt).to(tl.float32)), dt, INTERPRET_BF16)
        both = _round_to(acc, dt, INTERPRET_BF16) + _round_to(gate * shared, dt, INTERPRET_BF16)
        acc = tl.where(r < n, both, 0.0)
    if INTERPRET_BF16:
        acc = _round_bf16(acc)
    tl.store(out_ptr + r * s_ot + cols, acc.to(dt))
