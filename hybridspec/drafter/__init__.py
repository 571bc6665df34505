"""Drafters: the DFlash model and the protocol generation drives (`protocol.py`)."""

from hybridspec.drafter.config import DFlashConfig
from hybridspec.drafter.dflash import DFlashDrafter
from hybridspec.drafter.protocol import CompilableDrafter, DraftBlock, Drafter

__all__ = ["CompilableDrafter", "DFlashConfig", "DFlashDrafter", "DraftBlock", "Drafter"]
