"""What reading U experts' weights costs at best, for the MoE benchmark's floor column.

One Triton kernel, one launch: program (u, c) streams chunk c of expert `experts[u]`'s gate/up and
down weights (each expert's weights are two contiguous blocks) and writes one fp32 sum so the reads
are not optimised away. No routing, no arithmetic beyond the sum, no dependent launches: what an
MoE op cannot beat under the same CUDA graph, flush and timing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (elements per program, elements per load, warps); the floor is the fastest of them per case
CONFIGS = [(c, b, w) for c in (1 << 13, 1 << 14, 1 << 15, 1 << 16) for b in (2048, 4096) for w in (4, 8)]


@triton.jit
def _read_experts_kernel(gate_up_ptr, down_ptr, experts_ptr, out_ptr,
                         GU: tl.constexpr, DN: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    u = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(experts_ptr + u).to(tl.int64)
    n_gu: tl.constexpr = GU // CHUNK
    if c < n_gu:
        base = gate_up_ptr + e * GU + c * CHUNK
    else:
        base = down_ptr + e * DN + (c - n_gu) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, CHUNK, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + u * tl.num_programs(1) + c, tl.sum(acc))


def read_experts(gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor, config) -> torch.Tensor:
    """Sums of every chunk of the experts named in `experts` (int, on the GPU), reading each once."""
    chunk, block, warps = config
    gu, dn = gate_up[0].numel(), down[0].numel()
    if gu % chunk or dn % chunk or chunk % block:
        raise ValueError(f"chunk {chunk} must divide the expert blocks ({gu}, {dn}) and be a multiple of {block}")
    grid = (experts.numel(), (gu + dn) // chunk)
    out = torch.empty(grid, dtype=torch.float32, device=gate_up.device)
    _read_experts_kernel[grid](gate_up, down, experts, out, GU=gu, DN=dn, CHUNK=chunk, BLOCK=block, num_warps=warps)
    return out
