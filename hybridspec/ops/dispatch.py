"""Where an op body runs: the Triton kernel or the naive twin.

`TRITON_INTERPRET` is read by Triton when kernels are defined, so it is read here once, at import.
The launch counter lets tests prove that the Triton path ran (otherwise naive is compared with naive).
"""

from __future__ import annotations

import collections
import os

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

launch_counts: collections.Counter[str] = collections.Counter()


def use_triton(t: torch.Tensor) -> bool:
    if not HAS_TRITON:
        return False
    return t.is_cuda or (TRITON_INTERPRET and t.device.type == "cpu")


def count_launch(name: str) -> None:
    launch_counts[name] += 1
