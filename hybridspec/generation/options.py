"""The `generate` arguments hybridspec adds, validated once per call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POLICIES = ("hybridspec", "nominal", "no_two_stage", "static", "dcut", "evict")
# the policies of a batched round (batch size 2 and more; a fixed verify_length also works)
BATCH_POLICIES = ("hybridspec", "static")


@dataclass
class HybridSpecOptions:
    drafter: Any
    # a policy of `hybridspec.policy` (a fixed `verify_length` is a `FixedPolicy`)
    policy: Any
    streamer: Any
    # calibration's `RoundRecorder`, or None
    recorder: Any = None
    # an `AcceptRule` replacing the greedy / sampling rule of the rounds (`generate(hybridspec_accept=)`)
    accept: Any = None
    # the runner without CUDA graphs
    enforce_eager: bool = False
    # the host-driven reference loop even where the runner could serve the call
    reference_loop: bool = False
