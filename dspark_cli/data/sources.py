"""Where prompts come from: local JSONL / JSON / Parquet files (any fsspec URL, globs, comma lists)
or a Hugging Face dataset id. Yields raw rows, or the reason a raw record could not be decoded.
"""

from __future__ import annotations

import difflib
import glob as globlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from .. import storage
from ..errors import DsparkError, reading

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")
GLOB_CHARS = "*?["


@dataclass
class RawRow:
    """One record of an input: `row` decoded, or `error` saying why it could not be."""

    input: str
    index: int
    row: Any = None
    error: str | None = None
    error_kind: str = ""
    raw: str = ""


def is_local_source(source: str) -> bool:
    """A path, URL or glob of files (rather than a hub dataset id)."""
    first = source.split(",")[0].strip()
    if "://" in first or any(c in first for c in GLOB_CHARS) or first.endswith(LOCAL_SUFFIXES):
        return True
    return storage.exists(first) or _looks_like_a_path(first)


def _looks_like_a_path(text: str) -> bool:
    """A spelling no hub id has: absolute or ./ ~ relative, two or more '/', or a bare file name
    with a letter extension (`good40.jsnol`): such a typo is a missing file, not a hub lookup."""
    if text.startswith(("/", "./", "../", "~")) or text.count("/") >= 2:
        return True
    return "/" not in text and re.search(r"\.[A-Za-z][A-Za-z0-9]*$", text) is not None


def expand(source: str) -> list[str]:
    """Comma list of paths/URLs/globs → sorted concrete file URLs; DsparkError if one matches nothing."""
    urls: list[str] = []
    for item in (s.strip() for s in source.split(",")):
        if not item:
            continue
        fs, path = storage.url_to_fs(item)
        protocol = item.split("://", 1)[0] + "://" if "://" in item else ""
        if any(c in item for c in GLOB_CHARS):
            matches = sorted(fs.glob(path)) if protocol else sorted(globlib.glob(item))
            if not matches:
                raise DsparkError(f"data.source: '{item}' matches no file.")
            urls += [(protocol + m) if protocol and "://" not in m else m for m in matches]
        elif fs.isdir(path):
            found = sorted(p for p in fs.find(path) if p.endswith(LOCAL_SUFFIXES))
            if not found:
                raise DsparkError(f"data.source: folder '{item}' holds no .jsonl/.json/.parquet file.")
            urls += [(protocol + p) if protocol and "://" not in p else p for p in found]
        elif fs.exists(path):
            urls.append(item)
        else:
            raise DsparkError(f"data.source: file '{item}' not found.", hint=_close_names(item))
    return urls


def _close_names(item: str) -> str | None:
    """'did you mean …' from the names beside a missing local file, when one is close."""
    parent, name = os.path.split(item)
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return None
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
    return f"did you mean {os.path.join(parent, close[0])}?" if close else None


def _snippet(text: str | bytes, limit: int = 500) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return text[:limit]


def _lines(url: str, lines: Iterator[bytes]) -> Iterator[RawRow]:
    """JSON Lines from an iterator of raw lines (one file, streamed: memory does not grow with it).
    Numbering is `bytes.splitlines`'s: a bare CR ends a line too."""
    number = 0
    for chunk in lines:
        if number == 0:
            chunk = chunk.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM (Windows editors) is not row 1's text
        for line in chunk.splitlines() if b"\r" in chunk else (chunk.rstrip(b"\n"),):
            number += 1
            if not line.strip():
                continue
            yield _line_row(url, number, line)


def _line_row(url: str, number: int, line: bytes) -> RawRow:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return RawRow(url, number, error=f"line {number}: not valid UTF-8 ({e.reason})",
                      error_kind="not UTF-8", raw=_snippet(line))
    try:
        return RawRow(url, number, row=json.loads(text), raw="")
    except json.JSONDecodeError as e:
        return RawRow(url, number, error=f"line {number}: undecodable JSON ({e.msg})",
                      error_kind="undecodable JSON", raw=_snippet(text))


def _json_records(url: str, data: bytes) -> Iterator[RawRow]:
    """A .json file: one array of rows (or an object holding one), else treated as JSON Lines.
    A JSON document is parsed whole (use JSON Lines or Parquet for data sets larger than memory)."""
    try:
        obj = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        yield from _lines(url, iter(data.splitlines(keepends=True)))
        return
    if isinstance(obj, dict):
        lists = [v for v in obj.values() if isinstance(v, list)]
        is_row = bool({"conversations", "messages", "turns"} & set(obj))
        obj = lists[0] if len(lists) == 1 and not is_row else [obj]
    if not isinstance(obj, list):
        raise DsparkError(f"{url}: a JSON file must hold an array of rows.")
    for i, row in enumerate(obj):
        yield RawRow(url, i, row=row)


#: Rows decoded per Parquet batch: bounded memory whatever the file's row groups.
PARQUET_BATCH_ROWS = 4096


def _parquet_records(url: str, f: IO[bytes]) -> Iterator[RawRow]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise DsparkError(f"{url}: not a readable Parquet file ({e}).") from e
    index = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, use_threads=False):  # see io.read_table
        for row in batch.to_pylist():
            yield RawRow(url, index, row=row)
            index += 1


def read_local(url: str) -> Iterator[RawRow]:
    """The rows of one local/remote file, streamed (JSON Lines line by line, Parquet batch by batch,
    a .gz decompressed as it is read); only a .json document is read whole."""
    if not storage.exists(url):
        raise DsparkError(f"{url}: file not found.")
    fs, path = storage.url_to_fs(url)
    name = url.removesuffix(".gz")
    with reading(url, ()), fs.open(path, "rb") as raw:
        f: IO[bytes] = raw
        if url.endswith(".gz"):
            import gzip

            f = gzip.GzipFile(fileobj=raw, mode="rb")
        if name.endswith(".parquet"):
            yield from _parquet_records(url, f)
        elif name.endswith(".json"):
            yield from _json_records(url, f.read())
        else:
            yield from _lines(url, iter(f))


def _hub_error(dataset_id: str, split: str, e: Exception) -> DsparkError:
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    return DsparkError(
        f"could not load Hugging Face dataset '{dataset_id}' (split '{split}'): {message[:300]}",
        hint="check the id and your network (HF_HUB_OFFLINE), or pass local files: --source 'data/*.jsonl'.",
    )


def read_hub(dataset_id: str, split: str) -> Iterator[RawRow]:
    """Open a hub dataset as a stream now (so an unreachable hub fails before any output is
    written) and return its rows; one clear line when it cannot be reached."""
    from .. import hub

    if not hub.offline() and not hub.reachable():  # fail now, not after the hub client's retries
        raise DsparkError(f"data.source '{dataset_id}': not a local file, and the Hugging Face hub is "
                          "unreachable from here.",
                          hint="pass local files (--source 'data/*.jsonl'), or set HF_HUB_OFFLINE=1 to read "
                               "the dataset from the local cache.")
    try:
        import datasets

        stream = datasets.load_dataset(dataset_id, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - network, auth, missing dataset: one line for the user
        raise _hub_error(dataset_id, split, e) from None

    def rows() -> Iterator[RawRow]:
        try:
            for i, row in enumerate(stream):
                yield RawRow(f"hf://{dataset_id}[{split}]", i, row=row)
        except Exception as e:  # noqa: BLE001 - the connection dropped mid-stream
            raise _hub_error(dataset_id, split, e) from None

    return rows()


def read_source(source: str, split: str) -> tuple[list[str], Iterator[RawRow]]:
    """(input names for the manifest, raw rows) of data.source."""
    if is_local_source(source):
        urls = expand(source)

        def rows() -> Iterator[RawRow]:
            for url in urls:
                yield from read_local(url)

        return urls, rows()
    return [f"hf://{source}"], read_hub(source, split)
