"""The DSpark drafter: config, backbone, Markov/confidence heads, masks, export (contract 4)."""

from .config import DrafterConfig
from .drafter import DraftBlock, DSparkDrafter
from .export import export_drafter, load_drafter

__all__ = ["DrafterConfig", "DSparkDrafter", "DraftBlock", "export_drafter", "load_drafter"]
