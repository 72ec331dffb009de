"""[regen]: response regeneration through OpenAI-compatible endpoints (`dspark data regen`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..redact import url_without_credentials
from .base import Section


@dataclass
class RegenSettings(Section):
    name = "regen"
    #: Base URLs of OpenAI-compatible servers (…/v1). Requests are spread over them.
    endpoints: list[str] = field(default_factory=list)
    #: Model name sent in each request (as the server knows it).
    model: str = ""
    #: Requests in flight per endpoint.
    concurrency: int = 64
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int | None = 20
    min_p: float | None = 0.0
    max_tokens: int = 2048
    #: Sent as chat_template_kwargs.enable_thinking; the paper's data uses non-thinking mode.
    thinking: bool = False
    #: Environment variable holding the API key (never written anywhere).
    api_key_env: str = "OPENAI_API_KEY"
    #: Keep answers cut by max_tokens (finish_reason == "length"); default drops them to rejected.
    keep_truncated: bool = False
    #: Keep empty answers; default drops them to rejected.
    keep_empty: bool = False
    #: Retries for connection errors, timeouts, 429 and 5xx (then the prompt goes to the error file).
    max_retries: int = 8
    #: First retry delay in seconds; doubles per attempt, with jitter, up to `retry_max_delay`.
    retry_base_delay: float = 0.5
    #: Longest wait between retries, in seconds (a server's Retry-After is honoured up to this).
    retry_max_delay: float = 60.0
    #: Seconds before one request times out.
    request_timeout: float = 600.0
    #: The run fails (no manifest; the rerun retries the failed prompts) when more than this share
    #: of the prompts failed for good. A run that answered nothing always fails.
    max_error_share: float = 0.5
    #: Stop the run when its first this many attempts all failed the same way before any answer
    #: came (a dead endpoint, a request the server always refuses); 0 never stops early.
    fail_fast_after: int = 8
    #: Rows per committed output shard.
    batch_rows: int = 256
    #: Commit a partial batch after this many seconds, so slow runs lose little when killed.
    flush_seconds: float = 60.0
    #: pipeline run starts `dspark serve` on [target].model for this stage; for laptops and demos.
    serve_target: bool = False

    def to_dict(self) -> dict[str, Any]:
        """As stored in manifests and hashed: endpoints without any user:password@ in them."""
        values = super().to_dict()
        values["endpoints"] = [url_without_credentials(url) for url in self.endpoints]
        return values

    def validate(self) -> None:
        for i, url in enumerate(self.endpoints):
            self._check_endpoint(i, url)
        if self.concurrency <= 0:
            self.fail("concurrency", f"must be > 0, got {self.concurrency}.")
        if self.max_tokens <= 0:
            self.fail("max_tokens", f"must be > 0, got {self.max_tokens}.")
        if self.temperature < 0:
            self.fail("temperature", f"must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            self.fail("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.max_retries < 0:
            self.fail("max_retries", f"must be >= 0, got {self.max_retries}.")
        if not 0 <= self.max_error_share <= 1:
            self.fail("max_error_share", f"must be in [0, 1], got {self.max_error_share}.")
        if self.fail_fast_after < 0:
            self.fail("fail_fast_after", f"must be >= 0 (0: never stop early), got {self.fail_fast_after}.")
        if self.batch_rows <= 0:
            self.fail("batch_rows", f"must be > 0, got {self.batch_rows}.")
        if self.request_timeout <= 0:
            self.fail("request_timeout", f"must be > 0, got {self.request_timeout}.")
        if self.retry_base_delay < 0 or self.retry_max_delay < self.retry_base_delay:
            self.fail("retry_max_delay", f"must be >= retry_base_delay >= 0, got {self.retry_max_delay}.")
        if self.flush_seconds <= 0:
            self.fail("flush_seconds", f"must be > 0, got {self.flush_seconds}.")
        if self.top_k is not None and self.top_k < -1:
            self.fail("top_k", f"must be -1 (off) or >= 0, got {self.top_k}.")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            self.fail("min_p", f"must be in [0, 1], got {self.min_p}.")

    def _check_endpoint(self, i: int, url: str) -> None:
        """An endpoint is http(s)://host[:port]/…; name what is missing (the HTTP client only says
        'UnsupportedProtocol: /18001/models' for `localhost:18001/v1`)."""
        shown = url_without_credentials(url)
        key = f"endpoints[{i}]"
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number
        except ValueError as e:
            self.fail(key, f"{shown!r} is not a URL ({e}).")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            self.fail(key, f"{shown!r} has no http:// or https:// scheme; write e.g. "
                           f"'http://{shown.split('://')[-1]}'.")
        if parts.username is not None or parts.password is not None:
            self.fail(key, f"{shown!r} holds credentials (user:password@), which the OpenAI client "
                           f"refuses beside its API key header; put the key in ${self.api_key_env} "
                           "(regen.api_key_env) and drop it from the URL.")
