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


# sampled while each timed AR row runs: a clock that drops through a process (power or heat) would
# explain rows that run slower the later they come, the order effect docs/ar-step-levers.md notes
GPU_STATE_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "clocks_event_reasons.active")
GPU_STATE_KEYS = ("sm_clock_mhz", "mem_clock_mhz", "temperature_c", "power_w", "clock_event_reasons")


def parse_gpu_state(line: str, fields: tuple[str, ...] = GPU_STATE_FIELDS) -> dict:
    """One row of `nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits` -> numbers by
    `GPU_STATE_KEYS` (the event reasons kept as nvidia-smi's bit mask string; "[N/A]" as None)."""
    values = [v.strip() for v in line.split(",")]
    if len(values) != len(fields):
        raise ValueError(f"expected {len(fields)} values for {fields}, got {line!r}")
    out = {}
    for key, value in zip(GPU_STATE_KEYS, values):
        if value.startswith("[") or value in ("N/A", ""):
            out[key] = None
        elif key == "clock_event_reasons":
            out[key] = value
        else:
            out[key] = float(value)
    return out


def summarize_gpu_states(rows: list[dict]) -> dict:
    """Samples (`parse_gpu_state` rows) -> what a timed row needs to know: the lowest and the median
    SM clock, the lowest memory clock, the highest temperature and power, and every distinct set of
    clock-event reasons seen (nvidia-smi's masks; 0x0 is none)."""
    def values(key):
        return [r[key] for r in rows if r.get(key) is not None]

    sm, mem, temp, power = values("sm_clock_mhz"), values("mem_clock_mhz"), values("temperature_c"), values("power_w")
    return dict(samples=len(rows), sm_clock_mhz_min=min(sm, default=None),
                sm_clock_mhz_median=statistics.median(sm) if sm else None, mem_clock_mhz_min=min(mem, default=None),
                temperature_c_max=max(temp, default=None), power_w_max=max(power, default=None),
                clock_event_reasons=sorted(set(values("clock_event_reasons"))))


def _nvidia_smi_id() -> str:
    """nvidia-smi's name for this process's CUDA device: its UUID, since CUDA's device order and
    CUDA_VISIBLE_DEVICES need not match nvidia-smi's indices."""
    return f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"


class GpuSampler:
    """`with GpuSampler() as gpu: ...` samples this process's GPU with nvidia-smi every `interval_ms`
    while the block runs (a process of its own, so the timed host loop is not interrupted);
    `gpu.summary` is then `summarize_gpu_states` of the samples, or {"error": ...} where nvidia-smi
    is missing or refuses the query. Drivers without the clock-event reasons field are queried
    without it."""

    def __init__(self, interval_ms: int = 200):
        self.interval_ms, self.proc, self.fields, self.summary = interval_ms, None, GPU_STATE_FIELDS, {}

    def _command(self, fields, loop: bool) -> list[str]:
        cmd = ["nvidia-smi", "-i", _nvidia_smi_id(), f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
        return cmd + (["-lms", str(self.interval_ms)] if loop else [])

    def __enter__(self):
        import subprocess

        self.summary = {"error": "nvidia-smi gave no sample"}
        for fields in (GPU_STATE_FIELDS, GPU_STATE_FIELDS[:-1]):
            try:
                probe = subprocess.run(self._command(fields, False), capture_output=True, text=True, timeout=20)
            except (OSError, subprocess.TimeoutExpired) as err:
                self.summary = {"error": str(err)}
                return self
            if probe.returncode == 0:
                self.fields = fields
                self.proc = subprocess.Popen(self._command(fields, True), stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)
                return self
            self.summary = {"error": (probe.stderr or probe.stdout).strip()[:200]}
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=20)
            rows = []
            for line in out.splitlines():
                try:
                    rows.append(parse_gpu_state(line, self.fields))
                except ValueError:  # the line being written when the sampler was stopped
                    continue
            self.summary = summarize_gpu_states(rows) if rows else {"error": "nvidia-smi gave no sample"}
        return False


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


def start_gpu_run(script: str, acceptance: str) -> dict:
    """A GPU benchmark's opening: stop with a clear message where CUDA is missing, then print the
    environment and the acceptance line every results file carries. Returns the environment."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} measures a GPU: CUDA is not available")
    info = env_info()
    print(info)
    print(f"acceptance: {acceptance}")
    return info


def check_resident(programs: int, t: torch.Tensor) -> None:
    """A kernel whose programs wait for one another never ends unless all of them are resident at
    once: at most one program per SM here (each such kernel of ours fits one), and exactly one under
    the interpreter, which runs programs one after another."""
    from hybridspec.ops.dispatch import TRITON_INTERPRET

    interpreted = TRITON_INTERPRET or not t.is_cuda
    limit = 1 if interpreted else torch.cuda.get_device_properties(t.device).multi_processor_count
    if not 1 <= programs <= limit:
        where = "under the interpreter" if interpreted else f"on this GPU ({limit} SMs)"
        raise ValueError(f"{programs} programs that wait for one another cannot all be resident {where}: "
                         f"use 1 to {limit}")


def write_json(path: str | os.PathLike, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a value json cannot encode (a dtype, a compiler's config object) is written as its str rather
    # than losing the whole run's output at the last step
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}")


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[f"{c:.4f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for i, r in enumerate(cells):
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))
