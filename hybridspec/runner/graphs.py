"""A step function captured into a CUDA graph (all steps of a runner share one memory pool), or
run eagerly: on the CPU, or with `enforce_eager=True`."""

from __future__ import annotations

import gc
from typing import Callable

import torch

WARMUP_RUNS = 2


class CapturedStep:
    """`fn` takes no arguments and reads/writes static buffers only. Capture runs it
    `WARMUP_RUNS` times eagerly first (on a side stream, as CUDA graphs need; this also builds every
    lazily created constant), so the buffers hold garbage afterwards: load real inputs after it."""

    def __init__(self, fn: Callable[[], None], device: torch.device, enforce_eager: bool = False, pool=None):
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        if device.type != "cuda" or enforce_eager:
            return
        # the warm-up draws random numbers: leave the caller's generator state as it was
        with torch.random.fork_rng(devices=[device]):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    fn()
            torch.cuda.current_stream(device).wait_stream(side)
            # a runner the caller dropped lives on in a reference cycle (its step holds its bound
            # method) until the collector runs; if that happens inside this capture, freeing its graph
            # invalidates the capture ("operation failed due to a previous error during capture"), and
            # torch.cuda.graph no longer collects on entry: collect here, outside the capture
            gc.collect()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                fn()

    @property
    def captured(self) -> bool:
        return self.graph is not None

    @property
    def pool(self):
        return self.graph.pool() if self.graph is not None else None

    def __call__(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()
