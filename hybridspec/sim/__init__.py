"""Simulated acceptance, for benchmarks, calibration and tests only; the decoding path never
imports it. `replay`: drafters whose tokens replay the target's continuation with mistakes drawn
from a fixed acceptance model (host and device draws); `scripted`: a replay drafter with scripted
acceptance lengths for tests; `forced`: the accept rule that takes the draws' acceptance on
random-weight targets. Every figure obtained with these is simulated acceptance and says so."""
