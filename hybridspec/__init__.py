"""hybridspec: exact, fast speculative decoding for hybrid Gated-DeltaNet + MoE models."""

__version__ = "0.1.0.dev0"
