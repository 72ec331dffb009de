"""Helpers every stage command uses: load the config."""

from __future__ import annotations

from typing import Any

from ..config import PipelineConfig, load_config


def load(config: str | None, sets: list[str] | None, **extra: dict[str, Any]) -> PipelineConfig:
    """Config file + flag values (`extra`, None means 'not given') + --set overrides (last wins)."""
    return load_config(config, sets or [], extra=extra)

