"""`dspark serve`: (to be written)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the `serve` commands to the app."""
