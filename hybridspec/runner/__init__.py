"""The fast path: fixed-shape rounds with device-resident lengths, captured as CUDA graphs."""

from hybridspec.runner.runner import Runner

__all__ = ["Runner"]
