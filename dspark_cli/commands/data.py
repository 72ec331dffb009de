"""`dspark data`: (to be written)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the `data` commands to the app."""
