"""Helpers every stage command uses: load the config, say what a stage run will do."""

from __future__ import annotations

from typing import Any

from ..config import PipelineConfig, load_config
from ..console import console
from ..manifest import StageRun


def load(config: str | None, sets: list[str] | None, **extra: dict[str, Any]) -> PipelineConfig:
    """Config file + flag values (`extra`, None means 'not given') + --set overrides (last wins)."""
    return load_config(config, sets or [], extra=extra)


def announce(run: StageRun) -> bool:
    """Print the stage state; return True when there is nothing to do."""
    if run.state == "done":
        console.print(f"[green]✓[/] {run.stage}: {run.output_url} is complete with this config and "
                      "input; nothing to do (use --force to rebuild).")
        return True
    if run.state == "resume":
        console.print(f"[yellow]↻[/] {run.stage}: resuming the interrupted run in {run.output_url}.")
    else:
        console.print(f"[cyan]▶[/] {run.stage}: writing {run.output_url}.")
    return False
