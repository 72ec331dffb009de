"""The DSpark drafter: config, backbone, Markov/confidence heads, masks, export (contract 4).

The names below load on first use: `model.locate` and `model.config` must stay importable without
torch, so that a stage checks a drafter's folder before paying for torch (~2 s).
"""

from importlib import import_module
from typing import Any

_HOMES = {"DrafterConfig": ".config", "DSparkDrafter": ".drafter", "DraftBlock": ".drafter",
          "export_drafter": ".export", "load_drafter": ".export"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_HOMES[name], __name__), name)
