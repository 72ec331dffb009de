"""One error type for user mistakes: the CLI prints it as one line, never a traceback."""

from __future__ import annotations


class DsparkError(Exception):
    """A problem the user can fix (bad flag, bad file, wrong config). Message names the culprit."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class ConfigError(DsparkError):
    """A config key or value is wrong."""


class StageConflictError(DsparkError):
    """A stage's output exists with a different config or inputs; rerun with --force to replace it."""
