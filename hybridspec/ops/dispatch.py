"""Where an op body runs: the Triton kernel or the naive twin; whether its kernels use programmatic
dependent launch; the inductor options of the compiled layers around the ops.

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

# programmatic dependent launch of every op's kernels on sm90+ GPUs (hybridspec/ops/pdl_triton.py);
# HYBRIDSPEC_PDL=0 turns it off, for debugging and for the benchmarks' before / after
PDL = os.environ.get("HYBRIDSPEC_PDL", "1") != "0"

launch_counts: collections.Counter[str] = collections.Counter()


def use_triton(t: torch.Tensor) -> bool:
    if not HAS_TRITON:
        return False
    return t.is_cuda or (TRITON_INTERPRET and t.device.type == "cpu")


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel launched for `t` uses programmatic dependent launch: on, a CUDA tensor on an
    sm90+ GPU, and not interpreted (the interpreter also takes CUDA tensors, and fails on `gdc_*`)."""
    return (PDL and HAS_TRITON and not TRITON_INTERPRET and t.is_cuda
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


def pdl_launch(on: bool) -> dict:
    """The launch keyword of a kernel whose programs call `pdl_enter(USE_PDL=on)`."""
    return {"launch_pdl": True} if on else {}


# inductor settings for the compiled layers, passed as `torch.compile` options (so a user's global
# inductor config is left as it is). Measured on the H200, AR step of the 35B-A3B shape in one run
# (docs/benchmarks.md, "Launch overlap"): horizontal fusion of independent kernels (the conv with
# the gates, the q and k norms) and programmatic dependent launch of inductor's kernels (they wait
# for the kernel before them, as ours do: hybridspec/ops/pdl_triton.py) each took 0.25-0.3 ms off.
# HYBRIDSPEC_PDL=0 turns inductor's PDL off with ours. Coordinate-descent tuning of the launch
# settings of inductor's own kernels (the norms, the conv and gates, the residual adds); with it on,
# inductor also lowers a one-row matmul to a tuned reduction kernel of its own instead of cuBLAS
# (torch/_inductor/decomposition.py, `mm`), so the AR step's mixer input projections run there
# (83-85% of the H100's bytes, docs/benchmarks.md, "Where the AR step's time goes"); the 16-row
# verification graph keeps cuBLAS. AR step 3.323 against 3.382 ms and 3.298 against 3.395 on two
# H100s, about 13-25 s more compile time the first time (docs/benchmarks.md, 2026-12-06). A setting
# this torch lacks is left out.
LAYER_OPTIONS: dict = {"combo_kernels": True, "triton.enable_pdl": True, "coordinate_descent_tuning": True}


def layer_options() -> dict:
    """`LAYER_OPTIONS` that this torch's inductor knows, PDL only where `PDL` allows it."""
    import torch._inductor.config as config

    return {k: v for k, v in LAYER_OPTIONS.items() if hasattr(config, k) and (PDL or k != "triton.enable_pdl")}


def count_launch(name: str) -> None:
    launch_counts[name] += 1
