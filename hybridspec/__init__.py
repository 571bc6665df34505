"""hybridspec: exact, fast speculative decoding for hybrid Gated-DeltaNet + MoE models."""

from hybridspec.api import disable, enable
from hybridspec.drafter import DFlashDrafter

__version__ = "0.1.0.dev0"
__all__ = ["DFlashDrafter", "disable", "enable"]
