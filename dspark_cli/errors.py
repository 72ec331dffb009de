"""One error type for user mistakes: the CLI prints it as one line, never a traceback.

`environment_error` is the one boundary for what the operating system, the file formats and the
libraries raise (a missing path, a damaged file): the CLI turns those into the same one line.
"""

from __future__ import annotations

import errno
import gzip
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager


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


#: Modules whose own exception types mean "this file is damaged or not of its kind".
_FORMAT_MODULES = ("safetensors", "pyarrow", "zarr", "numcodecs", "gguf", "tomllib", "zlib", "gzip")
_OS_HINTS = {
    errno.ENOENT: "check the path (a typo?).",
    errno.EISDIR: "this is a folder; pass a file.",
    errno.ENOTDIR: "a part of this path is a file, not a folder.",
    errno.EACCES: "you lack permission here; pick another path or fix the permissions.",
    errno.EPERM: "you lack permission here; pick another path or fix the permissions.",
    errno.ENOSPC: "the disk is full; free space and rerun the same command to resume.",
    errno.EROFS: "this file system is read-only; pick another path.",
    errno.EEXIST: "remove it or pick another path.",
}


def environment_error(e: BaseException, where: str | None = None) -> DsparkError | None:
    """The one-line DsparkError for what the OS, a file format or a library raised (a missing or
    unreadable path, a damaged file), or None when `e` is none of those (a bug: keep the traceback).
    `where` names the file or flag when the exception itself does not."""
    if isinstance(e, DsparkError):
        return e
    first = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, OSError) and not _from_format_module(e):
        path = e.filename or where
        reason = (e.strerror or first or type(e).__name__).rstrip(".")
        if path is None:
            return DsparkError(f"{reason[:1].lower()}{reason[1:]}.", hint=_OS_HINTS.get(e.errno))
        target = f" → {e.filename2}" if e.filename2 else ""
        return DsparkError(f"{path}{target}: {reason[:1].lower()}{reason[1:]}.", hint=_OS_HINTS.get(e.errno))
    if isinstance(e, UnicodeDecodeError):
        byte = e.object[e.start:e.start + 1]
        return DsparkError(f"{where or 'an input file'}: not UTF-8 text (byte {byte!r} at offset {e.start}).",
                           hint="save the file as UTF-8.")
    if isinstance(e, json.JSONDecodeError):
        return DsparkError(f"{where or 'an input file'}: not valid JSON ({e.msg} at line {e.lineno}).")
    if isinstance(e, EOFError | zlib.error) or _from_format_module(e):
        detail = first or type(e).__name__
        return DsparkError(f"{where or 'an input file'}: damaged or not of its kind "
                           f"({type(e).__name__}: {detail}).",
                           hint="rebuild or re-download it (a truncated copy?); DSPARK_DEBUG=1 shows where.")
    return None


def _from_format_module(e: BaseException) -> bool:
    module = type(e).__module__ or ""
    return isinstance(e, gzip.BadGzipFile) or module.startswith(_FORMAT_MODULES)


@contextmanager
def reading(where: str, kinds: tuple[type[BaseException], ...] = (ValueError, KeyError)) -> Iterator[None]:
    """Inside the block, what the OS or a file format raises becomes one DsparkError naming `where`
    (also ValueError and KeyError by default: what a parser raises on a damaged file)."""
    try:
        yield
    except DsparkError:
        raise
    except Exception as e:
        mapped = environment_error(e, where)
        if mapped is None and isinstance(e, kinds):
            mapped = DsparkError(f"{where}: damaged or not of its kind ({_first_line(e)}).")
        if mapped is None:
            raise
        raise mapped from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
