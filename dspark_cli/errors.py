"""One error type for user mistakes: the CLI prints it as one line, never a traceback."""

from __future__ import annotations


class DsparkError(Exception):
    """A problem the user can fix (bad flag, bad file, wrong config). Message names the culprit."""

    #: The CLI's exit status: 2 for bad input (click's convention for usage errors).
    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class ConfigError(DsparkError):
    """A config key or value is wrong."""


class StageConflictError(DsparkError):
    """A stage's output exists with a different config or inputs; rerun with --force to replace it."""

    def __init__(self, message: str, hint: str | None = None,
                 config_keys: tuple[str, ...] = ()) -> None:
        super().__init__(message, hint)
        #: The dotted config keys whose values differ (a caller can say which --set keeps the run).
        self.config_keys = config_keys


class StageFailed(DsparkError):
    """A stage ran but produced nothing usable (or too many failures); nothing was marked done."""

    exit_code = 1
