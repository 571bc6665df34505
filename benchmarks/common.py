"""Timing and reporting shared by the GPU benchmarks: CUDA-graph capture (the runner's `CapturedStep`),
median timing, environment."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Callable

import torch

from hybridspec.runner.graphs import CapturedStep


def capture(fn: Callable[[], object], pool=None) -> torch.cuda.CUDAGraph:
    """`fn` warmed up on a side stream and captured into a CUDA graph, by the runner's own helper
    (`hybridspec.runner.graphs.CapturedStep`), so benchmarks and decoding capture alike."""
    step = CapturedStep(fn, torch.device("cuda"), pool=pool)
    torch.cuda.synchronize()
    return step.graph


def time_ms(run: Callable[[], object], replays: int = 10, samples: int = 30, before: Callable[[], object] | None = None) -> float:
    """Median over `samples` of the mean time of `replays` back-to-back calls, in ms (CUDA events)."""
    for _ in range(3):
        run()
    times = []
    for _ in range(samples):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def kernel_events(prof) -> list:
    """The GPU kernels a `torch.profiler` run recorded (copies and memsets left out), in its order."""
    return [e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
            and "memset" not in e.name.lower()]


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), replays=5, samples=10)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def env_info() -> dict:
    import transformers
    import triton

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "installed")
    except ImportError:
        info["fla"] = "not installed"
    return info


def write_json(path: str | os.PathLike, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[f"{c:.4f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for i, r in enumerate(cells):
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))
