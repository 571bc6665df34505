"""Small-batch MoE experts (SwiGLU) whose cost follows the distinct experts touched.

Up to BM token rows (16, or up to 64 for a batch of verification windows) with k assignments each. The grid's first axis runs over the T * k
assignment *slots* (slot s = row * k + j). A slot *leads* when its assignment is valid (row below
`num_tokens`, expert id in [0, E)) and no earlier valid slot chose the same expert; every other
slot's program exits at once. So each selected expert is handled by exactly one slot, and its
weights are read once per call however many rows chose it, without sorting or host syncs.

1. `moe_gate_up_kernel`, grid (slots, I / BN): the leading program of expert e multiplies all rows
   that chose e (others masked to zero, padded to BM rows for tl.dot; in GATHER pieces gathered
   into 16-row tiles, below) by its BN-row tiles of the gate and up projections and stores
   `silu(gate) * up` into expert e's rows of `h`.
2. `moe_down_kernel`, grid (slots, H / BN): the leading program multiplies `h[e]` `[BM, I]` by a
   BN-row tile of the down projection and stores the result for every (row, j) that chose e into
   the per-assignment buffer `y` `[BM, k, H]` (fp32).
3. `moe_reduce_kernel`, grid (T, H / BN): `out[r] = sum_j w[r, j] * y[r, j]` over valid
   assignments, in the fixed order j = 0..k-1 (deterministic, no atomics), cast to the output dtype.

`hybridspec::moe_experts_partials` launches the first two alone and returns `y` itself, its
consumer adding it (`moe_combine`, plain torch that inductor fuses into the residual add after the
block: one launch a layer less). There the down kernel runs with WRITE_ALL: the programs of slots
no expert program writes (invalid assignments, the shared slot of a piece with no counted row)
store zeros, so every slot of `y` is defined (in GATHER pieces the gate/up programs of those slots
store them instead).

With HAS_SHARED the block's shared expert runs as one more slot, slot T * k, chosen by every counted
row: its gate/up and down programs read the shared weights (`[2I, H]`, `[H, I]`, expert index E of
`h`) and store into the extra assignment k of `y` `[BM, k + 1, H]`; the reduce kernel then adds
`round(round(sigmoid(gate)) * round(shared))` to the routed sum rounded to the output dtype and
rounds again: the block-level roundings of transformers' sparse MoE block. One launch per stage for the
routed and shared experts together, instead of the shared expert's own GEMMs and elementwise work.

Pieces of more than 16 rows (GATHER: a batch of verification windows, B x w rows) tile each routed
expert by the rows that chose it, not by the piece: its leading program gathers those rows into
16-row tiles (RB) and loops over them (one tile but for an expert more than 16 rows chose), where a
BM-row tile would multiply 62 zero rows for an expert two rows chose (at B = 4 on the 35B-A3B shape
the batched round's weight kernels took 1.6x B = 1's time per expert). The shared expert, which
every row chose, keeps the BM-row tile and takes grid slot 0, so its programs are the first of each
column of the grid rather than the last. The program count is the same; invalid slots (the batch's
padding rows carry id -1) exit after two scalar loads instead of comparing the whole piece's ids,
and in the partials op their zeros come from the gate/up grid (`_zero_unwritten`), which has I / H
of the down grid's programs (a quarter at the 35B-A3B shape). On the H200 at B = 4 the round's MoE
blocks took 16-20% less (docs/benchmarks.md, "The batched round's tiles"). Pieces of up to 16 rows
(B = 1) compile to the instructions they had before GATHER existed.

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
def _slot_of(pid, T, K: tl.constexpr, HAS_SHARED: tl.constexpr, GATHER: tl.constexpr):
    """The slot grid program `pid` handles: in GATHER pieces the shared expert's slot T * K first
    (its BM-row tile is the longest program), the routed slots after it; else `pid` itself."""
    slot = pid
    if GATHER:
        if HAS_SHARED:
            slot = tl.where(pid == 0, T * K, pid - 1)
    return slot


@triton.jit
def _slot_leader_cheap(ids_ptr, num_tokens_ptr, slot, T, E, row_off,
                       K: tl.constexpr, SP: tl.constexpr, HAS_NUM_TOKENS: tl.constexpr, HAS_SHARED: tl.constexpr):
    """`_slot_leader`'s values, the piece's ids compared only for a valid slot: an invalid one (a
    padding row's id -1, a row past n) decides from two scalar loads."""
    n = T
    if HAS_NUM_TOKENS:
        n = tl.minimum(tl.load(num_tokens_ptr).to(tl.int32) - row_off, T)
    e = tl.load(ids_ptr + slot, mask=slot < T * K, other=E)
    valid = (slot // K < n) & (e >= 0) & (e < E)
    shared = slot == T * K
    lead = shared & (n > 0) if HAS_SHARED else slot < 0
    if valid:
        f = tl.arange(0, SP)
        ids = tl.load(ids_ptr + f, mask=f < T * K, other=-1)
        earlier = (f < slot) & (f // K < n) & (ids == e)
        lead = tl.sum(earlier.to(tl.int32)) == 0
    return n, e, lead, shared, valid


@triton.jit
def _zero_unwritten(y_ptr, slot, lead, shared, valid, T, H: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                    NPROG: tl.constexpr, ZB: tl.constexpr, HAS_SHARED: tl.constexpr):
    """Zeros into the slots of `y` `[BM, k (+1), H]` no expert program writes: an invalid routed
    assignment's row of H, and the shared expert's slot of a piece with no counted row. The slot's
    NPROG programs (grid axis 1) take every NPROG-th ZB-wide chunk of H each."""
    KY: tl.constexpr = K + 1 if HAS_SHARED else K
    i_p = tl.program_id(1)
    if (slot < T * K) & ~valid:
        for c0 in range(i_p * ZB, H, NPROG * ZB):
            c = c0 + tl.arange(0, ZB)
            tl.store(y_ptr + ((slot // K) * KY + slot % K) * H + c, tl.zeros([ZB], dtype=tl.float32), mask=c < H)
    if HAS_SHARED:
        if shared & ~lead:
            rows = tl.arange(0, BM)
            for c0 in range(i_p * ZB, H, NPROG * ZB):
                c = c0 + tl.arange(0, ZB)
                tl.store(y_ptr + (rows[:, None] * KY + K) * H + c[None, :], tl.zeros([BM, ZB], dtype=tl.float32),
                         mask=(rows < T)[:, None] & (c < H)[None, :])


@triton.jit
def _members(ids_ptr, e, n, T, K: tl.constexpr, BM: tl.constexpr, KP: tl.constexpr):
    """[BM]: the piece's counted rows that chose expert `e` (at any of their k assignments)."""
    rows = tl.arange(0, BM)
    cols = tl.arange(0, KP)
    ids2 = tl.load(ids_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < T) & (cols[None, :] < K), other=-1)
    return (rows < n) & (tl.max((ids2 == e).to(tl.int32), axis=1) > 0)


@triton.jit
def _gathered(member, c0, BM: tl.constexpr, RB: tl.constexpr):
    """Rows `c0 .. c0 + RB - 1` of the members in row order: `[RB]` row indices and which of them
    exist (a member's place among the members is the running count before it)."""
    rows = tl.arange(0, BM)
    m = member.to(tl.int32)
    place = tl.cumsum(m, axis=0) - 1  # [BM]
    want = c0 + tl.arange(0, RB)  # [RB]
    sel = (m[None, :] > 0) & (place[None, :] == want[:, None])  # [RB, BM]
    grow = tl.sum(tl.where(sel, rows[None, :], 0), axis=1)  # [RB]
    return grow, want < tl.sum(m)


@triton.jit
def _gate_up_tile(x_ptr, w_base, h_ptr, e, r, ok, s_xt, cols_n,
                  H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, MASK_STORE: tl.constexpr, PRECISION: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """`silu(x[r] @ gate[cols_n].T) * (x[r] @ up[cols_n].T)` for the `[R]` rows `r` (rows not `ok`
    read as zero) into `h[e, r, cols_n]` (only the `ok` rows with MASK_STORE)."""
    acc_g = tl.zeros([R, BN], dtype=tl.float32)
    acc_u = tl.zeros([R, BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        cols_k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + r[:, None] * s_xt + cols_k[None, :], mask=ok[:, None], other=0.0)
        # gate_up_proj[e] is [2I, H]: gate rows 0..I-1, up rows I..2I-1 (transformers' chunk order)
        wg = tl.load(w_base + cols_n[:, None] * H + cols_k[None, :])  # [BN, BK]
        wu = tl.load(w_base + (I + cols_n[:, None]) * H + cols_k[None, :])  # [BN, BK]
        # the interpreter multiplies bf16 bit patterns as integers: upcast there (exact products)
        if INTERPRET_BF16:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PRECISION)
    # SwiGLU
    act = acc_g * tl.sigmoid(acc_g) * acc_u  # [R, BN]
    if INTERPRET_BF16:
        act = _round_bf16(act)
    dst = h_ptr + (e.to(tl.int64) * BM + r[:, None]) * I + cols_n[None, :]
    if MASK_STORE:
        tl.store(dst, act.to(h_ptr.dtype.element_ty), mask=ok[:, None])
    else:
        tl.store(dst, act.to(h_ptr.dtype.element_ty))


@triton.jit
def _down_tile(h_ptr, w_ptr, sw_ptr, e, shared, rows, cols_n,
               H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """`h[e, rows] @ down_e[cols_n].T` `[R, BN]` in fp32 for the `[R]` row indices `rows` of `h`
    `[E (+1), BM, I]` (`down_e` the shared weight `[H, I]` on the shared expert's slot, else expert
    e's rows of `down_proj` `[E, H, I]`)."""
    w_base = w_ptr + e.to(tl.int64) * (H * I)
    if HAS_SHARED:
        if shared:
            w_base = sw_ptr
    acc = tl.zeros([R, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        cols_k = k0 + tl.arange(0, BK)
        h = tl.load(h_ptr + (e.to(tl.int64) * BM + rows[:, None]) * I + cols_k[None, :])  # [R, BK]
        w = tl.load(w_base + cols_n[:, None] * I + cols_k[None, :])  # [BN, BK]
        if INTERPRET_BF16:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def moe_gate_up_kernel(
    x_ptr, ids_ptr, num_tokens_ptr, w_ptr, sw_ptr, h_ptr, y_ptr,
    T, E, row_off, s_xt,
    H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    RB: tl.constexpr, BK_WIDE: tl.constexpr, GATHER: tl.constexpr, WRITE_ZEROS: tl.constexpr, ZB: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr, HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    slot = _slot_of(tl.program_id(0), T, K, HAS_SHARED, GATHER)
    i_n = tl.program_id(1)
    if GATHER:
        # this program's columns of I
        cols_n = i_n * BN + tl.arange(0, BN)  # [BN]
        n, e, lead, shared, valid = _slot_leader_cheap(ids_ptr, num_tokens_ptr, slot, T, E, row_off, K, SP,
                                                       HAS_NUM_TOKENS, HAS_SHARED)
        if WRITE_ZEROS:
            # the partials op's zeros, written here rather than by the down kernel, whose grid has
            # H / I times this one's programs (4x at the 35B-A3B shape): down writes expert outputs only
            _zero_unwritten(y_ptr, slot, lead, shared, valid, T, H, K, BM, I // BN, ZB, HAS_SHARED)
        if lead:
            if shared:
                # every counted row: the piece's BM-row tile (its H chunk narrower: shared memory)
                rows = tl.arange(0, BM)
                _gate_up_tile(x_ptr, sw_ptr, h_ptr, e, rows, rows < n, s_xt, cols_n, H, I, BM, BM, BN, BK_WIDE,
                              False, PRECISION, INTERPRET_BF16)
            else:
                member = _members(ids_ptr, e, n, T, K, BM, KP)
                w_base = w_ptr + e.to(tl.int64) * (2 * I * H)
                for c0 in range(0, tl.sum(member.to(tl.int32)), RB):
                    r, ok = _gathered(member, c0, BM, RB)
                    _gate_up_tile(x_ptr, w_base, h_ptr, e, r, ok, s_xt, cols_n, H, I, BM, RB, BN, BK,
                                  True, PRECISION, INTERPRET_BF16)
    else:
        # pieces of up to 16 rows: the kernel as it was before GATHER, statement for statement, so
        # B = 1's compiled code (and the gates measured on it) stay as they were
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
            w_base = w_ptr + e.to(tl.int64) * (2 * I * H)
            if HAS_SHARED:
                if shared:
                    w_base = sw_ptr
            _gate_up_tile(x_ptr, w_base, h_ptr, e, rows, member, s_xt, cols_n, H, I, BM, BM, BN, BK,
                          False, PRECISION, INTERPRET_BF16)


@triton.jit
def _store_assignments(y_ptr, ids_ptr, acc, e, r, ok, cols_n, T, H: tl.constexpr, K: tl.constexpr, KY: tl.constexpr):
    """`acc` `[R, BN]` into `y[r, j, cols_n]` for every (row, j) of the `ok` rows `r` that chose
    `e`: each gets its own copy, so a row naming e twice is counted twice."""
    for j in tl.static_range(K):
        e_j = tl.load(ids_ptr + r * K + j, mask=ok & (r < T), other=-1)
        chose = ok & (e_j == e)
        tl.store(y_ptr + (r[:, None] * KY + j) * H + cols_n[None, :], acc, mask=chose[:, None])


@triton.jit
def _store_shared(y_ptr, acc, rows, n, T, cols_n, H: tl.constexpr, K: tl.constexpr, KY: tl.constexpr,
                  WRITE_ALL: tl.constexpr):
    """The shared expert's `[BM, BN]` output into its assignment K of `y`, for rows below n (WRITE_ALL:
    below T as well; their inputs were masked to zero, so their output is zero)."""
    limit = T if WRITE_ALL else n
    tl.store(y_ptr + (rows[:, None] * KY + K) * H + cols_n[None, :], acc, mask=(rows < limit)[:, None])


@triton.jit
def moe_down_kernel(
    h_ptr, ids_ptr, num_tokens_ptr, w_ptr, sw_ptr, y_ptr,
    T, E, row_off,
    H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    RB: tl.constexpr, GATHER: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr, HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, USE_PDL: tl.constexpr, WRITE_ALL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    slot = _slot_of(tl.program_id(0), T, K, HAS_SHARED, GATHER)
    i_n = tl.program_id(1)
    # y's assignments per row: k, and the shared expert's after them
    KY: tl.constexpr = K + 1 if HAS_SHARED else K
    if GATHER:
        n, e, lead, shared, valid = _slot_leader_cheap(ids_ptr, num_tokens_ptr, slot, T, E, row_off, K, SP,
                                                       HAS_NUM_TOKENS, HAS_SHARED)
    else:
        n, e, lead, shared, valid = _slot_leader(ids_ptr, num_tokens_ptr, slot, T, E, row_off, K, SP,
                                                 HAS_NUM_TOKENS, HAS_SHARED)
    rows = tl.arange(0, BM)
    # this program's columns of H; down_proj[e] is [H, I]
    cols_n = i_n * BN + tl.arange(0, BN)  # [BN]
    if GATHER:
        # the zeros of slots no expert program writes came from the gate/up kernel (`_zero_unwritten`)
        if lead:
            if shared:
                acc = _down_tile(h_ptr, w_ptr, sw_ptr, e, shared, rows, cols_n, H, I, BM, BM, BN, BK, HAS_SHARED,
                                 PRECISION, INTERPRET_BF16)
                _store_shared(y_ptr, acc, rows, n, T, cols_n, H, K, KY, WRITE_ALL)
            else:
                member = _members(ids_ptr, e, n, T, K, BM, KP)
                for c0 in range(0, tl.sum(member.to(tl.int32)), RB):
                    r, ok = _gathered(member, c0, BM, RB)
                    acc_r = _down_tile(h_ptr, w_ptr, sw_ptr, e, shared, r, cols_n, H, I, BM, RB, BN, BK, False,
                                       PRECISION, INTERPRET_BF16)
                    _store_assignments(y_ptr, ids_ptr, acc_r, e, r, ok, cols_n, T, H, K, KY)
    else:
        # pieces of up to 16 rows: the kernel as it was before GATHER, statement for statement
        if lead:
            # the scalar as a row vector: the interpreter turns a scalar & vector mask into int32
            shared_rows = (rows * 0 + shared.to(tl.int32)) > 0  # [BM]
            acc = _down_tile(h_ptr, w_ptr, sw_ptr, e, shared, rows, cols_n, H, I, BM, BM, BN, BK, HAS_SHARED,
                             PRECISION, INTERPRET_BF16)
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
                    tl.store(y_ptr + (rows[:, None] * KY + K) * H + cols_n[None, :],
                             tl.zeros([BM, BN], dtype=tl.float32), mask=(rows < T)[:, None])


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
