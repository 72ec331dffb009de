"""Parquet shards of the data artifacts (contracts 1 and 2) and the one reader every stage uses.

    for row in read_rows("runs/x/responses", split="train"):
        row["messages"]  # [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]

An artifact is a folder with `data/part-NNNNN.parquet` shards. Each shard is written whole under
a temporary name and renamed (or PUT once on an object store), so a reader never sees half a shard
and a killed writer leaves nothing behind that a reader would take for data.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .. import storage
from ..errors import DsparkError

DATA_DIR = "data"
SHARD_RE = re.compile(r"^part-(\d{5,})\.parquet$")

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])

#: Contract 1: `dspark data prepare` rows (conversation without its assistant turns).
PROMPT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("split", pa.string()),
    ("messages", pa.list_(MESSAGE_TYPE)),
    ("original_assistant", pa.list_(pa.string())),
])

#: Contract 2: `dspark data regen` rows (full conversation with regenerated assistant turns).
RESPONSE_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("split", pa.string()),
    ("messages", pa.list_(MESSAGE_TYPE)),
    ("reasoning", pa.list_(pa.string())),
    ("thinking", pa.bool_()),
    ("model", pa.string()),
    ("endpoint", pa.string()),
    ("sampling", pa.string()),
    ("finish_reasons", pa.list_(pa.string())),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
])

#: A response row that the truncated/empty policy set aside, with why.
REJECTED_SCHEMA = RESPONSE_SCHEMA.append(pa.field("reason", pa.string()))

#: A prompt whose request failed for good (a 4xx, or retries exhausted), with the server's message.
ERROR_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("split", pa.string()),
    ("kind", pa.string()),
    ("status_code", pa.int64()),
    ("message", pa.string()),
    ("endpoint", pa.string()),
    ("turn", pa.int64()),
    ("attempts", pa.int64()),
])

#: An input row `data prepare` could not use, with why and where it came from.
QUARANTINE_SCHEMA = pa.schema([
    ("input", pa.string()),
    ("row", pa.int64()),
    ("reason", pa.string()),
    ("raw", pa.string()),
])


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def shard_index(name: str) -> int | None:
    match = SHARD_RE.match(name)
    return int(match.group(1)) if match else None


def list_shards(dir_url: str) -> list[str]:
    """URLs of the committed shards directly under dir_url, in index order."""
    names = [n for n in storage.listdir(dir_url) if shard_index(n) is not None]
    return [storage.join(dir_url, n) for n in sorted(names, key=lambda n: shard_index(n) or 0)]


def table_bytes(rows: list[dict[str, Any]], schema: pa.Schema) -> bytes:
    """Serialise rows to Parquet bytes (zstd); raises DsparkError naming a column that does not fit."""
    try:
        table = pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DsparkError(f"rows do not fit the Parquet schema: {e}") from e
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def write_table(url: str, rows: list[dict[str, Any]], schema: pa.Schema) -> None:
    """Write rows as one Parquet file, atomically (whole file or nothing)."""
    storage.write_bytes(url, table_bytes(rows, schema))


class SpooledTable:
    """Rows appended one at a time, written as one Parquet file at `commit`, in bounded memory:
    every `group_rows` rows become a row group of a local temporary file, which `commit` copies to
    its URL atomically (quarantine files can be as long as their input)."""

    def __init__(self, schema: pa.Schema, group_rows: int = 4096) -> None:
        import tempfile

        self.schema, self.group_rows = schema, group_rows
        self.num_rows = 0
        self.first: dict[str, Any] | None = None
        self._rows: list[dict[str, Any]] = []
        self._file = tempfile.TemporaryFile()
        self._writer = pq.ParquetWriter(self._file, schema, compression="zstd")

    def append(self, row: dict[str, Any]) -> None:
        if self.first is None:
            self.first = row
        self._rows.append(row)
        self.num_rows += 1
        if len(self._rows) >= self.group_rows:
            self._write_group()

    def _write_group(self) -> None:
        if self._rows:
            try:
                self._writer.write_table(pa.Table.from_pylist(self._rows, schema=self.schema))
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
                raise DsparkError(f"rows do not fit the Parquet schema: {e}") from e
            self._rows.clear()

    def commit(self, url: str) -> None:
        """Write the whole file to url (temporary name, then rename; one PUT on object stores)."""
        import shutil

        self._write_group()
        self._writer.close()
        self._file.flush()
        self._file.seek(0)
        with storage.atomic_open(url, "wb") as out:
            shutil.copyfileobj(self._file, out, 1 << 20)
        self.close()

    def close(self) -> None:
        """Drop the temporary file (after commit, or instead of it when the run failed)."""
        if not self._file.closed:
            self._writer.close()  # a no-op once committed
            self._file.close()


def read_table(url: str, columns: list[str] | None = None) -> pa.Table:
    """One whole shard, decoded on this thread. `pq.read_table` starts Arrow's worker pools (even
    with use_threads=False), and a process that exits soon after (an error right after reading)
    can then abort in their teardown: `terminate called without an active exception`, exit 134."""
    try:
        parquet = pq.ParquetFile(pa.BufferReader(storage.read_bytes(url)))
        return parquet.read(columns=columns, use_threads=False)
    except (pa.ArrowInvalid, OSError) as e:
        raise DsparkError(f"{url}: not a readable Parquet file ({e}).") from e


def read_file_rows(url: str, columns: list[str] | None = None) -> list[dict[str, Any]]:
    """All rows of one Parquet file ([] when it does not exist)."""
    if not storage.exists(url):
        return []
    return read_table(url, columns).to_pylist()


def iter_dir_rows(dir_url: str, columns: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(shard index, row) for every row of every committed shard under dir_url."""
    for url in list_shards(dir_url):
        index = shard_index(storage.basename(url))
        for row in read_table(url, columns).to_pylist():
            yield index or 0, row


@dataclass
class RowIndex:
    """Where every row of a data artifact lives, from the Parquet footers alone (no row decoded),
    so a reader that wants rows a..b (one cache-build worker's shards) decodes only the row groups
    holding them: its memory follows what it reads, not the artifact's size."""

    url: str
    files: list[tuple[str, list[int]]]  # (shard URL, rows of each of its row groups), in row order

    @property
    def num_rows(self) -> int:
        return sum(sum(groups) for _url, groups in self.files)

    def read(self, start: int, stop: int, columns: list[str] | None = None) -> list[dict[str, Any]]:
        """Rows start..stop-1 in artifact order (fewer at the end)."""
        out: list[dict[str, Any]] = []
        first = 0  # artifact row number of the current row group's first row
        for url, groups in self.files:
            wanted = []
            for g, n in enumerate(groups):
                if first < stop and first + n > start:
                    wanted.append((g, first, n))
                first += n
            if not wanted:
                continue
            table = _open_parquet(url, lambda f, w=wanted: f.read_row_groups([g for g, _, _ in w], columns,
                                                                         use_threads=False))
            lo = max(start - wanted[0][1], 0)
            out += table.slice(lo, min(stop, wanted[-1][1] + wanted[-1][2]) - wanted[0][1] - lo).to_pylist()
        return out


def _open_parquet(url: str, use: Any) -> Any:
    """`use(pq.ParquetFile)` on a shard opened for ranged reads; DsparkError naming a bad file."""
    fs, path = storage.url_to_fs(url)
    try:
        with fs.open(path, "rb") as f:
            return use(pq.ParquetFile(f))
    except (pa.ArrowInvalid, OSError) as e:
        raise DsparkError(f"{url}: not a readable Parquet file ({e}).") from e


def row_index(url: str) -> RowIndex:
    """The RowIndex of a data artifact (DsparkError when it holds no shards, as `read_rows`)."""
    shards = _data_shards(url)
    files = [(shard, _open_parquet(shard, lambda f: [f.metadata.row_group(g).num_rows
                                                     for g in range(f.metadata.num_row_groups)]))
             for shard in shards]
    return RowIndex(url, files)


def _data_shards(url: str) -> list[str]:
    shards = list_shards(storage.join(url, DATA_DIR))
    if not shards:
        raise DsparkError(f"{url}: no data shards found (expected {url}/{DATA_DIR}/part-NNNNN.parquet).",
                          hint="run `dspark data prepare` / `dspark data regen` to write it.")
    return shards


def read_rows(url: str, split: str | None = None, columns: list[str] | None = None) -> Iterator[dict]:
    """Rows of a data artifact (prompts or responses), shard by shard; `split` keeps one split.

    Raises DsparkError when url holds no shards, so a wrong URL is not read as an empty dataset.
    """
    if split not in (None, "train", "validation"):
        raise DsparkError(f"split must be 'train', 'validation' or None, got {split!r}.")
    shards = _data_shards(url)
    wanted = None if columns is None else list(dict.fromkeys([*columns, *(["split"] if split else [])]))
    for shard in shards:
        table = read_table(shard, wanted)
        for row in table.to_pylist():
            if split is None or row["split"] == split:
                if columns is not None and "split" not in columns:
                    row.pop("split", None)
                yield row
