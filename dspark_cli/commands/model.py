"""`dspark model`: (to be written)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the `model` commands to the app."""
