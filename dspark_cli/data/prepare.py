"""`dspark data prepare`: input rows → normalised prompt shards (contract 1) + quarantine.

    from dspark_cli.config import load_config
    prepare(load_config(None, ["data.source=chats.jsonl"]), "runs/x/prompts")

Streams the input once: each row is normalised (or quarantined with a reason), exact-duplicate
prompts are dropped, the split is a seeded hash of the id, and rows are written in shards of
`data.shard_rows`. Memory stays flat with the input's size: files are read line by line (Parquet
batch by batch), duplicates are found through 64-bit keys (`seen.SeenKeys`, ~24 bytes a row) and
quarantined rows are spooled to a temporary file. Shards are written whole under temporary names;
`manifest.json` is written last, so a killed run is simply redone (the output is a pure function of
input and config).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from .. import manifest, storage
from ..config import PipelineConfig
from ..errors import DsparkError
from ..stage import StageResult, already_done, completed
from . import io, sources
from .formats import RowError, normalise
from .seen import SeenKeys, key64

STAGE = "data.prepare"
QUARANTINE_NAME = "quarantine.parquet"


def split_of(sample_id: str, seed: int, val_fraction: float) -> str:
    """'validation' for a seeded-hash fraction of ids, else 'train'; stable across runs and inputs."""
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    return "validation" if u < val_fraction else "train"


def _quarantine(raw: sources.RawRow, reason: str) -> dict[str, Any]:
    return {"input": raw.input, "row": raw.index, "reason": reason, "raw": raw.raw[:500]}


def prepare(cfg: PipelineConfig, output_url: str | None = None, force: bool = False) -> StageResult:
    """Run the prepare stage for cfg.data into output_url (default `<work_dir>/prompts`); the
    summary is the manifest's counts (rows, train, validation, duplicates, quarantined, …)."""
    data = cfg.data
    output_url = output_url or cfg.stage_url("prompts")
    input_names, raw_rows = sources.read_source(data.source, data.split)
    inputs = {name: manifest.fingerprint(name) if not name.startswith("hf://") else f"id:{name}"
              for name in input_names}
    run = manifest.prepare_stage(STAGE, output_url, {"data": data.to_dict()}, inputs, force=force)
    if run.state == "done":
        return already_done(run)
    first = next(raw_rows, None)  # opens and parses the input before anything is claimed
    rows = raw_rows if first is None else itertools.chain([first], raw_rows)
    run.claim()
    try:
        return _write(cfg, output_url, run, input_names, rows)
    except BaseException:
        if run.state == "fresh":  # nothing worth resuming: the next run starts afresh
            run.abandon(io.DATA_DIR, QUARANTINE_NAME)
        raise


def _write(cfg: PipelineConfig, output_url: str, run: manifest.StageRun, input_names: list[str],
           raw_rows: Iterator[sources.RawRow]) -> StageResult:
    """Stream, normalise, dedupe, split and write; the manifest last."""
    quarantine = io.SpooledTable(io.QUARANTINE_SCHEMA)
    try:
        return _stream(cfg, output_url, run, input_names, raw_rows, quarantine)
    finally:
        quarantine.close()


def _stream(cfg: PipelineConfig, output_url: str, run: manifest.StageRun, input_names: list[str],
            raw_rows: Iterator[sources.RawRow], quarantine: io.SpooledTable) -> StageResult:
    data = cfg.data
    storage.clean_temporaries(output_url)
    data_url = storage.join(output_url, io.DATA_DIR)
    storage.remove(data_url)  # a resumed prepare is redone from the start: it is quick and pure

    started = time.time()
    seen_prompts = SeenKeys()  # first 8 bytes of the prompt's sha256
    seen_ids = SeenKeys(values=True)  # key64(id) → the input row it was first seen at
    reasons: Counter[str] = Counter()
    splits: Counter[str] = Counter()
    buffer: list[dict[str, Any]] = []
    counts = {"input_rows": 0, "rows": 0, "duplicates": 0, "quarantined": 0, "shards": 0}

    def flush() -> None:
        if buffer:
            io.write_table(storage.join(data_url, io.shard_name(counts["shards"])), buffer, io.PROMPT_SCHEMA)
            counts["shards"] += 1
            buffer.clear()

    for raw in raw_rows:
        if data.limit is not None and counts["rows"] >= data.limit:
            break
        counts["input_rows"] += 1
        if raw.error is not None:
            quarantine.append(_quarantine(raw, raw.error))
            reasons[raw.error_kind] += 1
            continue
        try:
            conv = normalise(raw.row)
        except RowError as e:
            raw.raw = raw.raw or _raw_text(raw.row)
            quarantine.append(_quarantine(raw, str(e)))
            reasons[e.kind] += 1
            continue
        prompt_hash = conv.prompt_hash()
        key = int(prompt_hash[:16], 16)
        if key in seen_prompts:
            counts["duplicates"] += 1
            continue
        sample_id = conv.source_id or f"h{prompt_hash[:24]}"
        id_key = key64(sample_id)
        first_row = seen_ids.get(id_key)
        if first_row is not None:
            raw.raw = raw.raw or _raw_text(raw.row)
            quarantine.append(_quarantine(raw, f"duplicate id {sample_id!r} with a different prompt "
                                               f"(first seen at row {first_row})"))
            reasons["duplicate id"] += 1
            continue
        seen_prompts.add(key)
        seen_ids.add(id_key, raw.index)
        split = split_of(sample_id, data.seed, data.val_fraction)
        splits[split] += 1
        buffer.append({
            "id": sample_id,
            "source": conv.source or _input_label(raw.input),
            "split": split,
            "messages": conv.messages,
            "original_assistant": conv.original_assistant,
        })
        counts["rows"] += 1
        if len(buffer) >= data.shard_rows:
            flush()
    flush()
    if counts["rows"] == 0:
        # Nothing is written (no quarantine file either): the line carries the first bad row.
        first = quarantine.first
        example = f"; e.g. {first['input']} row {first['row']}: {first['reason'][:160]}" if first else ""
        raise DsparkError(f"data.source '{data.source}': no usable conversation ({quarantine.num_rows} rows "
                          f"unusable, {counts['duplicates']} duplicates{example}).",
                          hint="rows need ShareGPT 'conversations', OpenAI 'messages' or 'turns'.")
    quarantine.commit(storage.join(output_url, QUARANTINE_NAME))
    counts["quarantined"] = quarantine.num_rows
    counts["train"] = splits["train"]
    counts["validation"] = splits["validation"]
    counts["quarantine_reasons"] = dict(reasons.most_common())
    final = run.finish(counts, extra={"inputs": input_names, "row_schema": "prompt_row/v1"},
                       timings={"prepare_seconds": round(time.time() - started, 3)})
    return completed(run, final, dict(counts))


def _raw_text(row: Any) -> str:
    """The start of a row as JSON, for the quarantine's `raw` column."""
    text = json.dumps(row, ensure_ascii=False, default=str)[:500]
    return text.encode("utf-8", errors="replace").decode("utf-8")


def _input_label(name: str) -> str:
    """Short source label for rows without one: the dataset id or the file's base name."""
    if name.startswith("hf://"):
        return name.removeprefix("hf://").split("[")[0]
    return storage.basename(name).split(".")[0]
