"""`hybridspec::gdn_verify` and `hybridspec::gdn_commit`: custom ops, fake kernels and host wrappers.

The ops are `torch.library.custom_op`s (docs/design.md, "Ops": this form passes `opcheck` and a
`fullgraph` compile on a machine without a GPU). Each body launches the Triton kernel for CUDA
tensors, and for CPU tensors under `TRITON_INTERPRET=1`; otherwise it runs the naive twin.
The wrappers validate; the kernels trust their inputs.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from hybridspec.ops import naive
from hybridspec.ops.checks import FLOAT_INPUTS, check, check_lengths
from hybridspec.ops.dispatch import count_launch, pdl_launch, use_pdl, use_triton

MAX_TOKENS = 16


class GDNFactors(NamedTuple):
    """Compact factors of one verification round, enough to commit any accepted length.

    `z` fp32 `[..., B, T, HV, V]`, `k` (l2-normalised keys) fp32 `[..., B, T, HK, K]`,
    `g_cum` (cumulative log decay) fp32 `[..., B, T, HV]`. A leading `L` dimension stacks layers.
    """

    z: torch.Tensor
    k: torch.Tensor
    g_cum: torch.Tensor


# Launch configuration of the kernels (value-column tile width, warps); benchmarks sweep these.
# The verify kernel's tile: `BV` value columns, widened (doubling, up to `BV_max`) while the grid
# keeps at least `min_programs` programs. At B = 1 and 2 the 35B-A3B shape (32 heads of 128 columns)
# keeps 32 (128 and 256 programs); at B = 4 it takes 64 (256 programs), which on the H200 measured
# 10.7 against 15 us a verify and 0.11-0.15 ms less GDN per round (docs/benchmarks.md,
# "Batched rounds: wider tiles"); at B = 1 the sweep's best stays 32 (benchmarks/sweep_gdn.py).
# `one_row` (0 or 1): a T = 1 call (the AR step) takes the kernel's one-row path, fp32 sums with no
# dots, with `BV_one_row` value columns a program: on an H100 the 16-row path took ~5.7 us a layer
# at T = 1 against ~0.6 us to read the state (gdn_verify_triton.py). On (2026-12-08): in four H100
# processes the AR step ran ~0.05 ms (1.5%) under the 16-row path's rows beside it (3.260 / 3.255
# against 3.310 / 3.308 on the last), and the runner and generation GPU tests pass with it on. Its
# fp32 sums give other bf16 tokens than the 16-row form's dots: both are the target's function
# (design.md, "What 'exact' means in bf16"); the fp32 tests hold either way (docs/benchmarks.md,
# "The one-row verify on by default")
# `gated_one_row` (0 or 1): the GDN mixer's AR step verifies and applies its gated RMSNorm in one
# kernel (`hybridspec.ops.gdn_gated`, one program per value head, `gated_BK` key rows a step,
# `gated_num_warps` warps) instead of the 16-row verify and inductor's two norm kernels. Off: on two
# H100s it is exact against the target in fp32 (the captured AR runner, both families) and the
# step's timeline lost the two norm kernels, but its one kernel (32 programs, each streaming a
# 64 KB state) took about what the three had, and the AR step was no faster beyond the spread of
# its off rows (3.245 against 3.178 / 3.235 ms; 3.267-3.269 against 3.276 / 3.345 ms;
# docs/benchmarks.md, "The GDN gated norm inside the one-row verify"). Not timed on an H200.
VERIFY_CONFIG = {"BV": 32, "BK": 64, "num_warps": 4, "BV_max": 64, "min_programs": 256, "one_row": 1,
                 "BV_one_row": 32, "gated_one_row": 0, "gated_BK": 32, "gated_num_warps": 8}
COMMIT_CONFIG = {"BV": 32, "num_warps": 4}
# fp32 dots on the GPU: "ieee" lowers to FMA loops that spill heavily at K = 128; 3xTF32 runs on
# tensor cores with ~1e-6 relative error. The interpreter computes every dot in plain fp32.
GPU_DOT_PRECISION = "tf32x3"


def _precision(t: torch.Tensor) -> str:
    return GPU_DOT_PRECISION if t.is_cuda else "ieee"


def _block_v(V: int, config: dict) -> int:
    return min(V, config["BV"])


def verify_block_v(V: int, rows: int, config: dict = VERIFY_CONFIG) -> int:
    """The verify kernel's value tile for `rows` (batch x value heads) programs per column tile:
    `BV`, doubled while it stays <= `BV_max` and <= V and the grid keeps `min_programs` programs."""
    bv = _block_v(V, config)
    while bv * 2 <= min(V, config["BV_max"]) and V // (bv * 2) * rows >= config["min_programs"]:
        bv *= 2
    return bv


def pow2_tile(dim: int, want: int) -> int:
    """`want` rounded down to a power of two (as `tl.arange` needs), at least 16 and at most `dim`
    (a power of two itself, so the tile divides it)."""
    return min(dim, 1 << (max(16, want).bit_length() - 1))


def verify_block_v_one_row(V: int, config: dict = VERIFY_CONFIG) -> int:
    """The one-row path's value tile: `BV_one_row` as a power-of-two tile of V (`pow2_tile`)."""
    return pow2_tile(V, config["BV_one_row"])


def _verify(q, k, v, g, beta, state, num_tokens, z_out, k_out, g_out, scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """The body of both verify ops: the kernel, or the naive twin (module docstring)."""
    B, T, HK, K = q.shape
    HV, V = v.shape[2:]
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    if use_triton(q):
        from hybridspec.ops.gdn_verify_triton import gdn_verify_kernel

        one_row = T == 1 and bool(VERIFY_CONFIG["one_row"])
        BV = verify_block_v_one_row(V) if one_row else verify_block_v(V, B * HV)
        pdl = use_pdl(q)
        gdn_verify_kernel[(V // BV, B * HV)](
            q, k, v, g, beta, state, num_tokens if num_tokens is not None else q,
            o, z_out, k_out, g_out,
            T, scale,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            g.stride(0), g.stride(1),
            beta.stride(0), beta.stride(1),
            HK=HK, HV=HV, K=K, V=V, BT=MAX_TOKENS, BV=BV, BK=min(K, VERIFY_CONFIG["BK"]),
            HAS_NUM_TOKENS=num_tokens is not None, USE_L2NORM=use_qk_l2norm, PRECISION=_precision(q),
            USE_PDL=pdl, ONE_ROW=one_row, num_warps=VERIFY_CONFIG["num_warps"], **pdl_launch(pdl),
        )
        count_launch("gdn_verify")
        return o
    twin = naive.gdn_verify(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm, num_tokens=num_tokens)
    return copy_twin((o, z_out, k_out, g_out), twin)


def copy_twin(outs: Sequence[torch.Tensor], twin: Sequence[torch.Tensor]) -> torch.Tensor:
    """A verify op's body off the kernel: the twin's `(o, z, k, g_cum)` into the op's output and
    factor buffers; returns the output."""
    for dst, src in zip(outs, twin):
        dst.copy_(src)
    return outs[0]


@torch.library.custom_op(
    "hybridspec::gdn_verify", mutates_args=("z_out", "k_out", "g_out"), device_types=None
)
def _gdn_verify_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    num_tokens: torch.Tensor | None,
    z_out: torch.Tensor,
    k_out: torch.Tensor,
    g_out: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    return _verify(q, k, v, g, beta, state, num_tokens, z_out, k_out, g_out, scale, use_qk_l2norm)


@_gdn_verify_op.register_fake
def _(q, k, v, g, beta, state, num_tokens, z_out, k_out, g_out, scale, use_qk_l2norm):
    B, T = q.shape[:2]
    return v.new_empty(B, T, *v.shape[2:])


def split_packed(qkv: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int):
    """`[B, T, 2 HK K + HV V]` -> views `q, k` `[B, T, HK, K]` and `v` `[B, T, HV, V]`."""
    B, T, C = qkv.shape
    key_dim = num_k_heads * head_k_dim
    q, k, v = torch.split(qkv, [key_dim, key_dim, C - 2 * key_dim], dim=-1)
    return (q.unflatten(-1, (num_k_heads, head_k_dim)), k.unflatten(-1, (num_k_heads, head_k_dim)),
            v.unflatten(-1, (-1, head_v_dim)))


# The packed form takes the GDN mixer's conv output whole. Inside a compiled layer the op's inputs
# must be real buffers: given q, k and v as three arguments, inductor wrote them as three buffers
# in a kernel of their own after the conv's (the split's sizes differ from the conv's 2 HK K + HV V
# channels, so neither kernel can take the other); one argument lets the conv's kernel write it.
@torch.library.custom_op(
    "hybridspec::gdn_verify_packed", mutates_args=("z_out", "k_out", "g_out"), device_types=None
)
def _gdn_verify_packed_op(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    num_tokens: torch.Tensor | None,
    z_out: torch.Tensor,
    k_out: torch.Tensor,
    g_out: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    q, k, v = split_packed(qkv, num_k_heads, head_k_dim, head_v_dim)
    return _verify(q, k, v, g, beta, state, num_tokens, z_out, k_out, g_out, scale, use_qk_l2norm)


@_gdn_verify_packed_op.register_fake
def _(qkv, g, beta, state, num_tokens, z_out, k_out, g_out, num_k_heads, head_k_dim, head_v_dim, scale,
      use_qk_l2norm):
    B, T, C = qkv.shape
    return qkv.new_empty(B, T, (C - 2 * num_k_heads * head_k_dim) // head_v_dim, head_v_dim)


@torch.library.custom_op("hybridspec::gdn_commit", mutates_args=("states",), device_types=None)
def _gdn_commit_op(
    states: torch.Tensor,
    z: torch.Tensor,
    k: torch.Tensor,
    g_cum: torch.Tensor,
    num_commit: torch.Tensor,
) -> None:
    L, B, HV, K, V = states.shape
    T, HK = k.shape[2], k.shape[3]
    if use_triton(states):
        from hybridspec.ops.gdn_commit_triton import gdn_commit_kernel

        BV = _block_v(V, COMMIT_CONFIG)
        pdl = use_pdl(states)
        gdn_commit_kernel[(V // BV, L * B * HV)](
            states, z, k, g_cum, num_commit,
            B, T,
            z.stride(0), k.stride(0), g_cum.stride(0),
            HK=HK, HV=HV, K=K, V=V, BT=MAX_TOKENS, BV=BV, PRECISION=_precision(states),
            USE_PDL=pdl, num_warps=COMMIT_CONFIG["num_warps"], **pdl_launch(pdl),
        )
        count_launch("gdn_commit")
        return
    naive.gdn_commit(states, z, k, g_cum, num_commit)


@_gdn_commit_op.register_fake
def _(states, z, k, g_cum, num_commit):
    return None


def _check_head_dim(name: str, d: int) -> None:
    check(
        16 <= d <= 256 and d & (d - 1) == 0,
        f"{name} head dim must be a power of two in [16, 256], got {d}",
    )


def gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    num_tokens: torch.Tensor | None = None,
    factors_out: GDNFactors | None = None,
) -> tuple[torch.Tensor, GDNFactors]:
    """Outputs of T <= 16 tokens from `state`, and the factors that commit any prefix of them.

    `q, k` `[B, T, HK, K]`, `v` `[B, T, HV, V]` (HV a multiple of HK), `g` (natural-log decay) and
    `beta` `[B, T, HV]`, `state` `[B, HV, K, V]` fp32 (not modified). `num_tokens` `[B]` int: rows
    at or past it are ignored (they may hold NaN) and their outputs are zero. Returns `o`
    `[B, T, HV, V]` in the dtype of `v`, equal to the token-by-token recurrence, and `GDNFactors`.
    `factors_out` supplies preallocated factor buffers (static addresses for CUDA graphs).
    """
    factors_out = _checked(q, k, v, g, beta, state, num_tokens, factors_out)
    o = _gdn_verify_op(
        q, k, v, g, beta, state, num_tokens, *factors_out,
        q.shape[-1]**-0.5 if scale is None else float(scale), use_qk_l2norm,
    )
    return o, GDNFactors(*factors_out)


def gdn_verify_packed(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    num_tokens: torch.Tensor | None = None,
    factors_out: GDNFactors | None = None,
) -> tuple[torch.Tensor, GDNFactors]:
    """`gdn_verify` on `qkv` `[B, T, 2 HK K + HV V]`: q, k and v side by side in the last dim, as
    the GDN mixer's conv writes them; the same kernel and results as `gdn_verify` on its split."""
    q, k, v = checked_split(qkv, num_k_heads, head_k_dim, head_v_dim)
    factors_out = _checked(q, k, v, g, beta, state, num_tokens, factors_out)
    o = _gdn_verify_packed_op(
        qkv, g, beta, state, num_tokens, *factors_out, num_k_heads, head_k_dim, head_v_dim,
        head_k_dim**-0.5 if scale is None else float(scale), use_qk_l2norm,
    )
    return o, GDNFactors(*factors_out)


def checked_split(qkv: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int):
    """`split_packed` after checking that `qkv` `[B, T, C]` splits into those heads."""
    check(qkv.dim() == 3, f"qkv must be [B, T, 2 HK K + HV V], got {tuple(qkv.shape)}")
    C = qkv.shape[-1]
    key_dim = num_k_heads * head_k_dim
    check(num_k_heads >= 1 and head_k_dim >= 1 and head_v_dim >= 1 and C > 2 * key_dim
          and (C - 2 * key_dim) % head_v_dim == 0,
          f"qkv's last dim {C} is not 2 x {num_k_heads} key heads x {head_k_dim} plus value heads of {head_v_dim}")
    return split_packed(qkv, num_k_heads, head_k_dim, head_v_dim)


def _checked(q, k, v, g, beta, state, num_tokens, factors_out: GDNFactors | None) -> GDNFactors:
    """Validate a verify call's inputs (`gdn_verify` says what they are); the factor buffers to
    write, allocated where none are given."""
    check(q.dim() == 4 and k.shape == q.shape, f"q and k must be [B, T, HK, K] alike, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, HK, K = q.shape
    check(1 <= T <= MAX_TOKENS, f"T must be in 1..{MAX_TOKENS}, got q {tuple(q.shape)}")
    check(v.dim() == 4 and v.shape[:2] == (B, T), f"v must be [B, T, HV, V] = [{B}, {T}, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[2:]
    check(HV % HK == 0, f"value heads ({HV}) must be a multiple of key heads ({HK}): v {tuple(v.shape)}, k {tuple(k.shape)}")
    _check_head_dim("key", K)
    _check_head_dim("value", V)
    check(g.shape == (B, T, HV) and beta.shape == (B, T, HV),
          f"g and beta must be [B, T, HV] = [{B}, {T}, {HV}], got g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    check(state.shape == (B, HV, K, V), f"state must be [B, HV, K, V] = [{B}, {HV}, {K}, {V}], got {tuple(state.shape)}")
    check(state.dtype == torch.float32 and state.is_contiguous(), f"state must be contiguous fp32, got {state.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check(t.dtype in FLOAT_INPUTS, f"{name} must be fp32, bf16 or fp16, got {t.dtype}")
        check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        check(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
    check_lengths("num_tokens", num_tokens, B, q.device)
    if factors_out is None:
        factors_out = GDNFactors(
            torch.empty(B, T, HV, V, dtype=torch.float32, device=q.device),
            torch.empty(B, T, HK, K, dtype=torch.float32, device=q.device),
            torch.empty(B, T, HV, dtype=torch.float32, device=q.device),
        )
    else:
        for name, t, shape in (
            ("z", factors_out.z, (B, T, HV, V)),
            ("k", factors_out.k, (B, T, HK, K)),
            ("g_cum", factors_out.g_cum, (B, T, HV)),
        ):
            check(
                t.shape == shape and t.dtype == torch.float32 and t.is_contiguous() and t.device == q.device,
                f"factors_out.{name} must be contiguous fp32 {list(shape)} on {q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}",
            )
    return GDNFactors(*factors_out)


def stack_factors(factors: Sequence[GDNFactors]) -> GDNFactors:
    """Stack per-layer factors along a new leading dim (a copy; preallocate stacked buffers to avoid it)."""
    return GDNFactors(*(torch.stack(parts) for parts in zip(*factors)))


def gdn_commit(
    states: torch.Tensor,
    factors: GDNFactors | Sequence[GDNFactors],
    num_commit: torch.Tensor,
) -> None:
    """Advance every layer's state in place by its first `num_commit[b]` verified tokens, in one launch.

    `states` `[L, B, HV, K, V]` contiguous fp32. `factors`: one `GDNFactors` with a leading `L`
    dimension (zero copy: give `gdn_verify` per-layer views of it as `factors_out`), or a list of
    `L` of them (stacked here, a copy). `num_commit` `[B]` int, `0 <= m <= T` (not checked on the
    device: that would need a host sync).
    """
    if not isinstance(factors, GDNFactors):
        factors = stack_factors(list(factors))
    check(states.dim() == 5, f"states must be [L, B, HV, K, V], got {tuple(states.shape)}")
    L, B, HV, K, V = states.shape
    check(states.dtype == torch.float32 and states.is_contiguous(), f"states must be contiguous fp32, got {states.dtype}")
    z, k, g_cum = factors
    check(z.dim() == 5 and z.shape[:2] == (L, B) and z.shape[3:] == (HV, V),
          f"factors.z must be [L, B, T, HV, V] = [{L}, {B}, T, {HV}, {V}], got {tuple(z.shape)}")
    T = z.shape[2]
    check(1 <= T <= MAX_TOKENS, f"T must be in 1..{MAX_TOKENS}, got factors.z {tuple(z.shape)}")
    check(k.dim() == 5 and k.shape[:3] == (L, B, T) and k.shape[4] == K and HV % k.shape[3] == 0,
          f"factors.k must be [L, B, T, HK, K] = [{L}, {B}, {T}, HK, {K}] with HV % HK == 0, got {tuple(k.shape)}")
    check(g_cum.shape == (L, B, T, HV), f"factors.g_cum must be [L, B, T, HV] = [{L}, {B}, {T}, {HV}], got {tuple(g_cum.shape)}")
    for name, t in (("z", z), ("k", k), ("g_cum", g_cum)):
        check(t.dtype == torch.float32 and t.device == states.device, f"factors.{name} must be fp32 on {states.device}, got {t.dtype} on {t.device}")
        check(t[0].is_contiguous(), f"factors.{name} must be contiguous per layer, got strides {t.stride()}")
    _check_head_dim("key", K)
    _check_head_dim("value", V)
    check_lengths("num_commit", num_commit, B, states.device)
    _gdn_commit_op(states, z, k, g_cum, num_commit)
