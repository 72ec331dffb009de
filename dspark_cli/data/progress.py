"""Live regen progress on stderr: done / total, requests/s, output tokens/s, errors, ETA."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..console import console as default_console

#: Seconds between plain status lines when stderr is not a terminal (logs of long runs).
LOG_EVERY = 60.0


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
    """A rich progress bar when stderr is a terminal; otherwise one status line a minute."""

    def __init__(self, total: int, counters: RegenCounters, enabled: bool | None = None,
                 console: Console | None = None) -> None:
        console = console or default_console
        self.console = console
        self.total = total
        self.counters = counters
        self.enabled = console.is_terminal if enabled is None else enabled
        self._progress = Progress(
            TextColumn("[bold]regen"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rates]}"), TimeRemainingColumn(),
            console=console, disable=not self.enabled, refresh_per_second=4,
        )
        self._task = self._progress.add_task("regen", total=total, rates="")
        self._last = 0.0
        self._last_log = time.monotonic()

    def __enter__(self) -> RegenProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.update(force=True)
        self._progress.stop()

    def status(self) -> str:
        """'done/total, req/s, tok/s, errors, rejected, ETA' as one line."""
        c = self.counters
        req_s, tok_s = c.rates()
        left = self.total - c.done
        eta = f"{left / (c.done / c.elapsed):.0f} s" if c.done else "?"
        return (f"{c.done}/{self.total} done, {req_s:.1f} req/s, {tok_s:.1f} output tok/s, "
                f"errors {c.errors}, rejected {c.rejected}, ETA {eta}")

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled:
            if now - self._last_log >= LOG_EVERY:
                self._last_log = now
                self.console.print(f"regen: {self.status()}", highlight=False)
            return
        if not force and now - self._last < 0.25:
            return
        self._last = now
        c = self.counters
        req_s, tok_s = c.rates()
        rates = f"{req_s:6.1f} req/s {tok_s:8.1f} tok/s  errors {c.errors}  rejected {c.rejected}"
        self._progress.update(self._task, completed=c.done, rates=rates)
