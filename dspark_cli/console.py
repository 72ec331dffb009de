"""The shared rich console (stderr for progress, so stdout stays machine-readable)."""

from __future__ import annotations

from rich.console import Console

console = Console(stderr=True)
out = Console()


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KB': sizes as the cache and plan commands print them."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"
