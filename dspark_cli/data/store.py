"""The responses artifact on disk, laid out so that `kill -9` at any moment loses no prompt and
never yields one twice.

    {url}/data/part-NNNNN.parquet      responses of batch N (contract 2, read by read_rows)
    {url}/rejected/part-NNNNN.parquet  answers of batch N set aside by the truncated/empty policy
    {url}/errors/part-NNNNN.parquet    prompts of batch N whose request failed for good
    {url}/rejected.parquet, errors.parquet   compacted views, rewritten when a run ends (`finish`,
                                       which reads each committed file once)

Every prompt of a run lands in exactly one file of exactly one batch, and each file is written
whole (temporary name, then rename; one PUT on object stores). A batch index is never reused, so a
run that died between a batch's files simply redoes the prompts whose file is missing. Resume reads
the ids of the committed files: done = data ∪ rejected ∪ errors. An error retried with success
leaves its old error record behind until compaction; the error *view* drops ids that are now in
data or rejected and keeps only the latest record per id, so readers never see a resolved error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .. import storage
from . import io

REJECTED_DIR = "rejected"
ERRORS_DIR = "errors"
REJECTED_NAME = "rejected.parquet"
ERRORS_NAME = "errors.parquet"


@dataclass
class StoreState:
    """Ids already settled in the output, and the next free batch index."""

    ok: set[str] = field(default_factory=set)
    rejected: set[str] = field(default_factory=set)
    errors: set[str] = field(default_factory=set)  # unresolved ones only
    next_index: int = 0

    @property
    def settled(self) -> set[str]:
        return self.ok | self.rejected | self.errors


@dataclass
class OutputSummary:
    """The whole output after a run, from one read of each file: settled ids and manifest counts."""

    ok: set[str]
    rejected: set[str]
    errors: set[str]  # unresolved ones only
    counts: dict[str, Any]

    @property
    def settled(self) -> set[str]:
        return self.ok | self.rejected | self.errors


class ResponseStore:
    """Batches of results under one output URL (see the module docstring for the layout)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.data_url = storage.join(url, io.DATA_DIR)
        self.rejected_url = storage.join(url, REJECTED_DIR)
        self.errors_url = storage.join(url, ERRORS_DIR)

    def _ids(self, dir_url: str) -> tuple[set[str], int]:
        ids: set[str] = set()
        last = -1
        for shard in io.list_shards(dir_url):
            last = max(last, io.shard_index(storage.basename(shard)) or 0)
            ids.update(io.read_table(shard, ["id"]).column("id").to_pylist())
        return ids, last

    def scan(self) -> StoreState:
        """Read the committed ids (cleaning a killed writer's temporaries first)."""
        storage.clean_temporaries(self.url)
        ok, last_ok = self._ids(self.data_url)
        rejected, last_rej = self._ids(self.rejected_url)
        errors, last_err = self._ids(self.errors_url)
        return StoreState(ok, rejected, errors - ok - rejected, max(last_ok, last_rej, last_err) + 1)

    def write_batch(self, index: int, ok: list[dict[str, Any]], rejected: list[dict[str, Any]],
                    errors: list[dict[str, Any]]) -> None:
        """Commit one batch: each non-empty part as one whole file named by the batch index."""
        name = io.shard_name(index)
        if errors:
            io.write_table(storage.join(self.errors_url, name), errors, io.ERROR_SCHEMA)
        if rejected:
            io.write_table(storage.join(self.rejected_url, name), rejected, io.REJECTED_SCHEMA)
        if ok:
            io.write_table(storage.join(self.data_url, name), ok, io.RESPONSE_SCHEMA)

    def _latest_errors(self) -> dict[str, tuple[int, dict[str, Any]]]:
        """id → (batch index, record) of the latest error per id, minus ids answered or rejected."""
        resolved = self._ids(self.data_url)[0] | self._ids(self.rejected_url)[0]
        return _latest(io.iter_dir_rows(self.errors_url), resolved)

    def error_view(self) -> list[dict[str, Any]]:
        """Unresolved errors: the latest record per id, minus ids now answered or rejected."""
        return [row for _index, row in self._latest_errors().values()]

    def finish(self) -> OutputSummary:
        """Read every committed file once: write the errors.parquet / rejected.parquet views, prune
        resolved error records, and return the settled ids and the manifest's counts.

        Pruning rewrites each error shard whole; a kill midway leaves stale records that the view
        still hides, so this is safe to interrupt and to repeat.
        """
        # The answered rows are counted shard by shard from Arrow columns, not gathered as dicts:
        # at 200k+ responses a list of row dicts was the largest thing a regen run held.
        ok_ids: set[str] = set()
        responses = prompt_tokens = completion_tokens = 0
        for shard in io.list_shards(self.data_url):
            table = io.read_table(shard, ["id", "prompt_tokens", "completion_tokens"])
            ok_ids.update(table.column("id").to_pylist())
            responses += table.num_rows
            prompt_tokens += sum(v or 0 for v in table.column("prompt_tokens").to_pylist())
            completion_tokens += sum(v or 0 for v in table.column("completion_tokens").to_pylist())
        rejected = [row for _i, row in io.iter_dir_rows(self.rejected_url)]
        by_shard: dict[str, list[dict[str, Any]]] = {}
        recorded: list[tuple[int, dict[str, Any]]] = []
        for shard in io.list_shards(self.errors_url):
            index = io.shard_index(storage.basename(shard)) or 0
            by_shard[shard] = io.read_table(shard).to_pylist()
            recorded += [(index, row) for row in by_shard[shard]]
        rejected_ids = {r["id"] for r in rejected}
        latest = _latest(recorded, ok_ids | rejected_ids)
        for shard, rows in by_shard.items():
            index = io.shard_index(storage.basename(shard))
            kept = [r for r in rows if latest.get(r["id"], (None,))[0] == index]
            if len(kept) != len(rows):
                if kept:
                    io.write_table(shard, kept, io.ERROR_SCHEMA)
                else:
                    storage.remove(shard)
        errors = [row for _index, row in latest.values()]
        io.write_table(storage.join(self.url, ERRORS_NAME), errors, io.ERROR_SCHEMA)
        io.write_table(storage.join(self.url, REJECTED_NAME), rejected, io.REJECTED_SCHEMA)
        reasons: dict[str, int] = {}
        for row in rejected:
            reasons[row["reason"]] = reasons.get(row["reason"], 0) + 1
        counts = {
            "responses": responses,
            "rejected": len(rejected),
            "rejected_truncated": reasons.get("truncated", 0),
            "rejected_empty": reasons.get("empty", 0),
            "errors": len(errors),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "shards": len(io.list_shards(self.data_url)),
        }
        return OutputSummary(ok_ids, rejected_ids, set(latest), counts)


def _latest(recorded: Iterable[tuple[int, dict[str, Any]]], resolved: set[str]
            ) -> dict[str, tuple[int, dict[str, Any]]]:
    """id → (batch index, record) of the latest error per id not in `resolved` (index order in)."""
    latest: dict[str, tuple[int, dict[str, Any]]] = {}
    for index, row in recorded:
        if row["id"] not in resolved:
            latest[row["id"]] = (index, row)  # shards come in index order: later wins
    return latest
