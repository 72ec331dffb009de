"""Offline first: whether a Hugging Face hub id can be fetched, decided at once.

Without this, a machine with no route to the hub spends ~27 s in huggingface_hub's five retries
before the error. `access` answers from HF_HUB_OFFLINE, one short TCP connect to the hub (once per
process) and the local HF cache: fetch normally, read only the cache, or a one-line error now.
"""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse

from .errors import DsparkError

#: Seconds the one reachability probe may take (DNS failure and refusal answer at once).
PROBE_TIMEOUT = 3.0
_TRUE = {"1", "on", "yes", "true"}


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE / HF_DATASETS_OFFLINE) is set."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


@functools.cache
def reachable() -> bool:
    """One TCP connect to the hub endpoint (HF_ENDPOINT, default https://huggingface.co)."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=PROBE_TIMEOUT):
            return True
    except OSError:
        return False


def cached(repo_id: str, filename: str = "config.json", revision: str | None = None,
           repo_type: str = "model") -> bool:
    """`filename` of the hub repo is in the local HF cache."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, filename, revision=revision, repo_type=repo_type),
                          str)
    except Exception:  # noqa: BLE001 - an invalid id is simply not cached
        return False


def access(repo_id: str, what: str, hint: str, filename: str = "config.json", revision: str | None = None,
           repo_type: str = "model") -> bool:
    """True: read `repo_id` from the local cache only; False: fetch normally. Raises a one-line
    DsparkError naming `what` at once when the hub cannot be used and the cache lacks it."""
    if offline():
        if cached(repo_id, filename, revision, repo_type):
            return True
        raise DsparkError(f"{what} {repo_id!r}: not a local folder, and HF_HUB_OFFLINE is set while the "
                          "local Hugging Face cache does not hold it.", hint=hint)
    if reachable():
        return False
    if cached(repo_id, filename, revision, repo_type):
        return True
    raise DsparkError(f"{what} {repo_id!r}: not a local folder, and the Hugging Face hub is unreachable "
                      "from here (nor is it in the local cache).", hint=hint)
