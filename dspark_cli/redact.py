"""What a server or a library says, made fit for one line on disk or screen: secrets removed, HTML
reduced to its title or text, whitespace collapsed, length capped.

A server may echo the request's Authorization header or key in its error body (proxies do), and
regen stores error messages in `errors.parquet`; every such message goes through `clean`.
"""

from __future__ import annotations

import html
import re

REDACTED = "[REDACTED]"
#: Bearer tokens, `sk-…` style keys and `api_key=…` parameters, whatever key the run uses.
_PATTERNS = [
    re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(r"\b(sk|pk|rk|hf|ghp|gho|xox[abp])[-_][A-Za-z0-9_-]{8,}"),
    re.compile(r"(?i)\b(api[_-]?key|access[_-]?token|authorization)(['\"]?\s*[:=]\s*['\"]?)(?!bearer\b|\[REDACTED)[^\s'\",;&]{6,}"),
]
#: user:password@ inside a URL (an endpoint with basic auth): the host stays, the credentials go.
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"]+@")
_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """Remember a secret (an API key read from the environment) so `redact` removes it anywhere."""
    if value and len(value) >= 4 and value != "EMPTY":
        _secrets.add(value)


def redact(text: str) -> str:
    """`text` with registered secrets and anything shaped like a token replaced by [REDACTED]."""
    for secret in sorted(_secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    text = url_without_credentials(text)
    text = _PATTERNS[0].sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    text = _PATTERNS[1].sub(REDACTED, text)
    return _PATTERNS[2].sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)


def url_without_credentials(text: str) -> str:
    """`text` with every URL's `user:password@` replaced by `[REDACTED]@` (what manifests store)."""
    return _URL_CREDENTIALS.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)


_TITLE = re.compile(r"(?is)<title[^>]*>(.*?)</title>")
_TAG = re.compile(r"(?s)<(script|style)\b.*?</\1>|<[^>]+>")


def shorten(text: str, limit: int = 300) -> str:
    """One readable line: an HTML page becomes its <title> (or its text), whitespace collapses,
    and anything past `limit` characters is cut with '…'."""
    text = str(text)
    if "<html" in text[:500].lower() or "<!doctype" in text[:200].lower():
        title = _TITLE.search(text)
        body = title.group(1) if title else _TAG.sub(" ", text)
        text = "HTML page: " + html.unescape(body)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def clean(text: str, limit: int = 300) -> str:
    """`redact` then `shorten`: what a stored or printed server message goes through."""
    return shorten(redact(str(text)), limit)
