"""What a stage hands back, and the one line a finished stage prints.

Every stage function — `data.prepare.prepare`, `data.regen.regen`, `cache.build.build_cache`,
`train.trainer.train`, `decode.stages.run_calibrate` / `run_eval` / `run_profile` — returns a
`StageResult`, so a command (or a script) reads every stage the same way: its state, where it
wrote, its manifest, and a small summary of the artifact that the command prints as is (no
command reopens its own stage's output to say what it holds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .console import console
from .manifest import StageRun, read_manifest

#: done: complete before this call, nothing was done; fresh: written by this call from nothing;
#: resumed: an interrupted (or reopened) run completed by this call; skipped: completed without
#: doing the work, for a reason the summary's "skipped" gives (e.g. a drafter without confidence head).
ResultState = Literal["done", "fresh", "resumed", "skipped"]


@dataclass
class StageResult:
    """One stage call's outcome. `manifest` is None only when this process did not commit it
    (another cache-build worker will, or this is not training's rank 0)."""

    stage: str
    state: ResultState
    output_url: str
    manifest: dict[str, Any] | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, Any]:
        return (self.manifest or {}).get("counts", {})

    @property
    def done(self) -> bool:
        """True when the call found the stage complete and did nothing."""
        return self.state == "done"


def completed(run: StageRun, manifest: dict[str, Any] | None, summary: dict[str, Any],
              skipped: bool = False) -> StageResult:
    """The result of a run that did its work (fresh or resumed) — or chose to skip it."""
    state: ResultState = "skipped" if skipped else ("fresh" if run.state == "fresh" else "resumed")
    return StageResult(run.stage, state, run.output_url, manifest, summary)


def already_done(run: StageRun, summarise: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                 ) -> StageResult:
    """The result of a call that found the stage complete: its committed manifest, and the summary
    `summarise(manifest)` gives (default: the manifest's counts)."""
    found = read_manifest(run.output_url) or {}
    summary = summarise(found) if summarise is not None else dict(found.get("counts", {}))
    return StageResult(run.stage, "done", run.output_url, found or None, summary)


def nothing_to_do(label: str, url: str, hint: str = "use --force to rebuild",
                  why: str = "is complete with this config and input") -> None:
    """The one 'already done' line (stderr), for every stage and for `model convert`; never
    wrapped, so logs and scripts can grep it whatever the terminal width."""
    console.print(f"[green]✓[/] {label}: {url} {why}; nothing to do ({hint}).", soft_wrap=True)


def say_if_done(result: StageResult, label: str, hint: str = "use --force to rebuild") -> bool:
    """Print the 'nothing to do' line when the call found the stage complete; True then."""
    if result.done:
        nothing_to_do(label, result.output_url, hint)
    return result.done
