"""Every read and write goes through here: fsspec URLs, temporary names, commit markers.

Local files are written to a temporary sibling and `os.replace`d into place, so a reader never sees
half a file and `kill -9` leaves at most an orphaned temporary. Object stores (S3, memory) make a
single PUT visible atomically, so there a plain write already commits. Directories of many files
are committed by a marker written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import DsparkError, reading

COMMIT_MARKER = "_COMMITTED"
TMP_PREFIX = ".tmp-"


def url_to_fs(url: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a path or URL to (filesystem, path); local paths get parent dirs made on write."""
    protocol = fsspec.core.split_protocol(str(url))[0]
    if protocol in (None, "file", "local"):
        storage_options.setdefault("auto_mkdir", True)
    if protocol == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            storage_options.setdefault("client_kwargs", {}).setdefault("endpoint_url", endpoint)
    fs, path = fsspec.core.url_to_fs(str(url), **storage_options)
    return fs, path


def canonical(url: str) -> str:
    """The same location spelled one way: local paths become absolute (`runs/x`, `./runs/x`,
    `file:///…/runs/x` are one input); remote URLs are kept as written."""
    protocol = fsspec.core.split_protocol(str(url))[0]
    return fsspec.core.strip_protocol(str(url)) if protocol in (None, "file", "local") else str(url)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def join(url: str, *parts: str) -> str:
    """Join URL parts with '/', keeping the protocol prefix."""
    url = str(url).rstrip("/")
    return "/".join([url, *(p.strip("/") for p in parts if p)])


def basename(url: str) -> str:
    return posixpath.basename(str(url).rstrip("/"))


def exists(url: str) -> bool:
    fs, path = url_to_fs(url)
    return fs.exists(path)


def makedirs(url: str) -> None:
    fs, path = url_to_fs(url)
    fs.makedirs(path, exist_ok=True)


def listdir(url: str) -> list[str]:
    """Names (not paths) directly under url, sorted; [] when it does not exist."""
    fs, path = url_to_fs(url)
    if not fs.exists(path):
        return []
    names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)]
    return sorted(n for n in names if n)


def remove(url: str, recursive: bool = True) -> None:
    fs, path = url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=recursive)


def read_bytes(url: str) -> bytes:
    fs, path = url_to_fs(url)
    try:
        with reading(url, ()), fs.open(path, "rb") as f:
            return f.read()
    except DsparkError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            raise DsparkError(f"{url}: file not found.") from e.__cause__
        raise


def read_text(url: str) -> str:
    """UTF-8 text (a leading BOM dropped); a file that is not text is one line naming it."""
    with reading(url, ()):
        return read_bytes(url).decode("utf-8-sig")


def read_json(url: str) -> Any:
    try:
        return json.loads(read_text(url))
    except json.JSONDecodeError as e:
        raise DsparkError(f"{url}: not valid JSON ({e.msg} at line {e.lineno}).") from e


@contextmanager
def atomic_open(url: str, mode: str = "wb") -> Iterator[IO]:
    """Open url for writing; the content appears under url only if the block finishes."""
    fs, path = url_to_fs(url)
    if is_local(fs):
        parent = posixpath.dirname(path)
        fs.makedirs(parent, exist_ok=True)
        tmp = posixpath.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}-{posixpath.basename(path)}")
        try:
            with open(tmp, mode) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    else:
        # One PUT on an object store is atomic: readers see the old object or the whole new one.
        with fs.open(path, mode) as f:
            yield f


def write_bytes(url: str, data: bytes) -> None:
    with atomic_open(url, "wb") as f:
        f.write(data)


def write_text(url: str, text: str) -> None:
    write_bytes(url, text.encode("utf-8"))


def write_json(url: str, obj: Any) -> None:
    write_text(url, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def commit(url: str, payload: dict[str, Any] | None = None) -> None:
    """Mark a directory complete. Written last: its presence means every other file is in place."""
    write_json(join(url, COMMIT_MARKER), payload or {})


def is_committed(url: str) -> bool:
    return exists(join(url, COMMIT_MARKER))


def clean_temporaries(url: str) -> int:
    """Remove orphaned temporaries left by a killed local writer; returns how many."""
    fs, path = url_to_fs(url)
    if not is_local(fs) or not fs.exists(path):
        return 0
    removed = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            if name.startswith(TMP_PREFIX):
                os.remove(os.path.join(root, name))
                removed += 1
    return removed


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_url(url: str, chunk_size: int = 1 << 20) -> str:
    fs, path = url_to_fs(url)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def check_output(output_url: str, inputs: list[str] = (), flag: str = "--output (-o)") -> None:
    """Refuse an output URL that is an existing file, or that is, contains or sits inside an input:
    writing there would destroy the input (and --force would delete it)."""
    fs, path = url_to_fs(output_url)
    if fs.isfile(path):
        raise DsparkError(f"{output_url}: output is an existing file; stages write a folder.",
                          hint=f"pass a new folder as {flag}.")
    out = canonical(output_url).rstrip("/")
    for url in inputs:
        if "://" not in str(url) and not os.path.exists(str(url)):
            continue  # a hub id or a name, not a location
        src = canonical(url).rstrip("/")
        if out == src or out.startswith(src + "/") or src.startswith(out + "/"):
            where = "is" if out == src else "is inside" if out.startswith(src + "/") else "contains"
            raise DsparkError(f"{output_url}: output {where} the input {url}.",
                              hint="write the output to a separate folder.")
