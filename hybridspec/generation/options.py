"""The `generate` arguments hybridspec adds, validated once per call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POLICIES = ("hybridspec", "nominal", "no_two_stage", "static", "dcut", "evict")


@dataclass
class HybridSpecOptions:
    drafter: Any
    verify_length: int | None
    policy: Any
    streamer: Any
    cache_kwarg: str
