"""What to do when a request fails: retry (with backoff, jitter, Retry-After) or give up and record.

The openai client runs with `max_retries=0`; this module is the only retry policy, so its bound
and its classification are the ones the user configured:
- retried: connection errors, timeouts, 408/409, 429 (waiting at least Retry-After), 5xx, and
  malformed bodies (a proxy or a crashing server, usually transient);
- recorded at once: every other 4xx, with the server's message.
"""

from __future__ import annotations

import email.utils
import json
import random
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import openai

from ..redact import clean

RETRYABLE_STATUS = {408, 409, 429}
#: Longest server message kept (stored in errors.parquet, shown in warnings).
MESSAGE_LIMIT = 500


@dataclass
class Failure:
    """A failed attempt: its kind, whether to retry, and what the server said."""

    kind: str
    retryable: bool
    message: str
    status_code: int | None = None
    retry_after: float | None = None


class RequestFailed(Exception):
    """A request failed for good; carries the last failure and the attempts made."""

    def __init__(self, failure: Failure, attempts: int) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.attempts = attempts


class MalformedResponse(Exception):
    """The server answered 200 with a body that is not a chat completion."""


def parse_retry_after(headers: object) -> float | None:
    """Seconds from `retry-after-ms` / `retry-after` (seconds or HTTP date); None when absent."""
    get = getattr(headers, "get", None)
    if get is None:
        return None
    ms = get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        parsed = email.utils.parsedate_tz(value)
        if parsed is None:
            return None
        return max(0.0, email.utils.mktime_tz(parsed) - time.time())


def _server_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
    if isinstance(body, str):
        return body
    if body is not None:
        return json.dumps(body, default=str)
    return exc.message


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _refused(exc: BaseException) -> OSError | None:
    """The OS error under a failed connect (the aiohttp transport reports a refused connection as a
    *connect timeout*), or None when the connection was not refused or unreachable."""
    for cause in _causes(exc):
        if isinstance(cause, ConnectionRefusedError | socket.gaierror):
            return cause
        os_error = getattr(cause, "os_error", None)
        if isinstance(os_error, ConnectionRefusedError | socket.gaierror):
            return os_error
    return None


def classify(exc: BaseException) -> Failure:
    """Map an exception from one request to a Failure (retryable or not); its message is cleaned
    (secrets redacted, HTML pages cut to their title, one line) before anyone stores or prints it."""
    failure = _classify(exc)
    failure.message = clean(failure.message, MESSAGE_LIMIT)
    return failure


def _classify(exc: BaseException) -> Failure:
    refused = _refused(exc)
    if refused is not None:
        what = "host not found" if isinstance(refused, socket.gaierror) else "connection refused"
        return Failure("connection", True, f"{what} ({refused})")
    if isinstance(exc, openai.APITimeoutError):
        return Failure("timeout", True, "request timed out")
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        detail = f"{type(cause).__name__}: {cause}" if cause else str(exc)
        return Failure("connection", True, f"connection error ({detail})")
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        message = _server_message(exc)
        if status == 429:
            return Failure("rate_limit", True, message, status, parse_retry_after(exc.response.headers))
        if status >= 500 or status in RETRYABLE_STATUS:
            return Failure("server_error" if status >= 500 else "http_status", True, message, status,
                           parse_retry_after(exc.response.headers))
        return Failure("http_status", False, message, status)
    if isinstance(exc, MalformedResponse | openai.APIResponseValidationError | ValueError):
        return Failure("malformed", True, f"malformed response ({type(exc).__name__}: {exc})")
    return Failure("unexpected", False, f"{type(exc).__name__}: {exc}")


@dataclass
class RetryPolicy:
    """Bounded exponential backoff with jitter; a server's Retry-After is a floor (up to the cap)."""

    max_retries: int = 8
    base_delay: float = 0.5
    max_delay: float = 60.0

    def delay(self, attempt: int, failure: Failure, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `attempt` (0-based)."""
        rng = rng or random
        backoff = min(self.max_delay, self.base_delay * (2 ** attempt))
        wait = backoff / 2 + rng.uniform(0, backoff / 2)  # "equal jitter": spread, never zero
        if failure.retry_after is not None:
            wait = max(wait, failure.retry_after)
        return min(wait, self.max_delay)

    def should_retry(self, attempt: int, failure: Failure) -> bool:
        return failure.retryable and attempt < self.max_retries


@dataclass
class FailFast:
    """Stop a run whose first `window` attempts all failed the same way before any succeeded: a
    dead endpoint or a request every prompt gets wrong would otherwise retry each prompt at full
    backoff (101 s for 4 prompts with the default 8 retries) before saying the same thing."""

    window: int = 8
    attempts: int = 0
    succeeded: bool = False
    first: Failure | None = None
    alike: bool = True

    def success(self) -> None:
        self.succeeded = True

    def failed(self, failure: Failure) -> bool:
        """Count a failed attempt; True when the run should stop now."""
        if self.succeeded:
            return False
        if self.first is None:
            self.first = failure
        elif (failure.kind, failure.status_code, failure.message) != \
                (self.first.kind, self.first.status_code, self.first.message):
            self.alike = False
        self.attempts += 1
        return self.alike and 0 < self.window <= self.attempts
