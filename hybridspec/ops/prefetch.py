"""Which weights a latency-bound kernel asks into L2 (hybridspec/ops/prefetch_triton.py), and the
kernel arguments that carry them.

An op that takes `prefetch` (a list of tensors: `gdn_verify_packed`, `decode_attention`) hands its
kernel up to `MAX_REGIONS` of them; the model code names the weights its layer reads next. Whether
the kernel asks for them is `KERNEL_CONFIG.mode`, read at launch (so a captured graph keeps the mode
it was captured under). Off where the kernel would not take it: no sm90 GPU, the interpreter, a
region not 16-byte aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.ops.checks import check
from hybridspec.ops.dispatch import TRITON_INTERPRET

MAX_REGIONS = 3


@dataclass
class PrefetchConfig:
    """`mode` 0: off; 1: bulk prefetch (one `cp.async.bulk.prefetch.L2` per thread); 2: one
    `prefetch.global.L2` per 128-byte line. `ahead_mb`: the MoE router's kernel asks for the first
    this many MiB of the next layer's input projection (0: not), in `mode` (1 where mode is 0).
    `experts_evict_first`: the experts op loads its weights with L2's evict-first policy, so that
    its ~50 MB stream does not push out what was asked for ahead."""

    mode: int = 0
    ahead_mb: int = 0
    experts_evict_first: int = 0
    # 1: the verify and attention kernels ask after their own work instead of before it
    at_end: int = 0
    # at most this many of the regions an op is given
    regions: int = MAX_REGIONS


KERNEL_CONFIG = PrefetchConfig()


def prefetch_args(regions, ref: torch.Tensor, num_warps: int, ahead: bool = False) -> dict:
    """The kernel arguments `pf{i}_ptr`, `pf{i}_bytes`, `NUM_PF`, `PF_MODE`, `PF_THREADS` for
    `regions` (at most `MAX_REGIONS` tensors, each read whole from its first element: contiguous),
    for a kernel of `num_warps` warps launched for `ref`'s device; `NUM_PF` 0 where the mode is off
    or the kernel would not take them. `ahead`: regions read a layer later, asked for up to
    `ahead_mb` MiB each, and only where that is on."""
    cfg = KERNEL_CONFIG
    mode = (cfg.mode or 1) if ahead and cfg.ahead_mb > 0 else (0 if ahead else cfg.mode)
    limit = cfg.ahead_mb << 20 if ahead else None
    usable = [] if not mode or TRITON_INTERPRET or not ref.is_cuda or torch.cuda.get_device_capability(ref.device)[0] < 9 \
        else [t for t in regions if t.is_cuda and t.device == ref.device and t.is_contiguous() and t.data_ptr() % 16 == 0]
    usable = usable[:min(MAX_REGIONS, cfg.regions)]
    args = {"NUM_PF": len(usable), "PF_MODE": mode or 1, "PF_THREADS": 32 * num_warps,
            "PF_AT_END": bool(cfg.at_end) and not ahead}
    for i in range(MAX_REGIONS):
        t = usable[i] if i < len(usable) else ref
        args[f"pf{i}_ptr"] = t
        size = t.numel() * t.element_size() if i < len(usable) else 0
        args[f"pf{i}_bytes"] = size if limit is None else min(size, limit)
    return args


def checked_regions(prefetch) -> list[torch.Tensor]:
    """An op wrapper's `prefetch` argument as the op's list, checked: at most `MAX_REGIONS` tensors."""
    prefetch = list(prefetch)
    check(len(prefetch) <= MAX_REGIONS and all(isinstance(t, torch.Tensor) for t in prefetch),
          f"prefetch takes at most {MAX_REGIONS} tensors, got {[type(t).__name__ for t in prefetch]}")
    return prefetch
