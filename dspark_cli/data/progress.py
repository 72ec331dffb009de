"""Live regen progress on stderr: done / total, requests/s, output tokens/s, errors, ETA."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..console import console


@dataclass
class RegenCounters:
    """Running totals of one regen run (this process only)."""

    done: int = 0
    ok: int = 0
    rejected: int = 0
    errors: int = 0
    requests: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def elapsed(self) -> float:
        return max(1e-9, time.monotonic() - self.started)

    def rates(self) -> tuple[float, float]:
        """(requests/s, output tokens/s) since the start."""
        return self.requests / self.elapsed, self.completion_tokens / self.elapsed


class RegenProgress:
    """A rich progress bar when stderr is a terminal, silent otherwise (the command prints a summary)."""

    def __init__(self, total: int, counters: RegenCounters, enabled: bool | None = None) -> None:
        self.counters = counters
        self.enabled = console.is_terminal if enabled is None else enabled
        self._progress = Progress(
            TextColumn("[bold]regen"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rates]}"), TimeRemainingColumn(),
            console=console, disable=not self.enabled, refresh_per_second=4,
        )
        self._task = self._progress.add_task("regen", total=total, rates="")
        self._last = 0.0

    def __enter__(self) -> RegenProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.update(force=True)
        self._progress.stop()

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < 0.25):
            return
        self._last = now
        c = self.counters
        req_s, tok_s = c.rates()
        rates = f"{req_s:6.1f} req/s {tok_s:8.1f} tok/s  errors {c.errors}  rejected {c.rejected}"
        self._progress.update(self._task, completed=c.done, rates=rates)
