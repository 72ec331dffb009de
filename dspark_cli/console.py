"""The shared rich console (stderr for progress, so stdout stays machine-readable)."""

from __future__ import annotations

from rich.console import Console

console = Console(stderr=True)
out = Console()
