"""`dspark cache build`: run the target over the regenerated responses and store its features.

    build_cache(cfg, "runs/x/responses", "runs/x/cache")                    # one machine
    build_cache(cfg, resp, "s3://b/cache", num_workers=8, worker_index=3)   # one of eight

Input rows are cut into shards of `cache.samples_per_shard` in input order, so every worker agrees
on the shard set without talking; worker i builds shards k with k % N == i, and reads only their
rows (the Parquet footers say where each row lives). A committed shard is
skipped on rerun; anything else is rebuilt from scratch, so a kill at any point loses at most the
shards in flight and a rerun produces identical bytes. The target forward runs in the main thread;
a bounded background writer encodes and uploads finished shards meanwhile. Whoever finds every
shard committed writes the manifest (or `dspark cache finalize` does).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import manifest, storage
from ..config import PipelineConfig
from ..console import console, fmt_bytes
from ..data import io
from ..errors import DsparkError, StageFailed
from ..sample import Sample
from ..schemas import validate
from ..stage import StageResult, already_done, completed
from ..target.files import load_config, num_layers
from ..target.layers import resolve_layers
from ..target.model import Target
from ..target.samples import INPUT_COLUMNS, forward_samples, render_rows
from . import RESPONSES_HINT, fp8, store
from .verify import summary as cache_summary

LAYOUT_NAME = "_layout.json"
STAGE = "cache"
#: Rows of one inner Zarr chunk: a sample read touches at most two chunks it does not need.
CHUNK_TOKENS = 64


def worker_rank(num_workers: int | None, worker_index: int | None) -> tuple[int, int]:
    """(rank, world) from flags, else torchrun's RANK/WORLD_SIZE, else (0, 1)."""
    world = num_workers if num_workers is not None else int(os.environ.get("WORLD_SIZE", "1"))
    rank = worker_index if worker_index is not None else int(os.environ.get("RANK", "0"))
    if world < 1:
        raise DsparkError(f"--num-workers must be >= 1, got {world}.")
    if not 0 <= rank < world:
        raise DsparkError(f"--worker-index must be in 0..{world - 1}, got {rank}.")
    return rank, world


def stage_config(cfg: PipelineConfig, layers: list[int]) -> dict[str, Any]:
    """What determines the cache's bytes (not device or batch size, so a rerun may change those)."""
    t, c = cfg.target, cfg.cache
    return {
        "target": {"model": t.model, "revision": t.revision, "dtype": t.dtype, "layers": layers,
                   "trust_remote_code": t.trust_remote_code},
        "cache": {"max_length": c.max_length, "min_loss_tokens": c.min_loss_tokens,
                  "storage_dtype": c.storage_dtype, "compression": c.compression,
                  "samples_per_shard": c.samples_per_shard, "chunk_tokens": CHUNK_TOKENS},
    }


@dataclass
class ShardJob:
    index: int
    samples: list[Sample]
    skipped: dict[str, int]
    skipped_ids: list[str]


@dataclass
class Stats:
    tokens: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    shards: int = 0
    forward_s: float = 0.0
    render_s: float = 0.0
    write_s: float = 0.0
    wait_s: float = 0.0
    started: float = field(default_factory=time.time)


def _bits(x: torch.Tensor) -> np.ndarray:
    """bf16 tensor → its uint16 bits."""
    return x.contiguous().view(torch.int16).numpy().view(np.uint16)


def assemble(job: ShardJob, storage_dtype: str, layers: list[int], d: int) -> store.ShardData:
    """Concatenate a shard's samples token-major in input order."""
    m, samples = len(layers), job.samples
    lengths = [len(s.input_ids) for s in samples]
    loss = [s.num_loss_tokens for s in samples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    final_offsets = np.concatenate([[0], np.cumsum(loss)]).astype(np.int64)
    if samples:
        hidden = torch.cat([s.hidden_states for s in samples])  # [N, m*d]
        final = torch.cat([s.final_hidden for s in samples])  # [K, d]
        input_ids = torch.cat([s.input_ids for s in samples]).numpy().astype(np.int32)
        loss_mask = torch.cat([s.loss_mask for s in samples]).numpy().astype(np.uint8)
    else:
        hidden = torch.zeros(0, m * d, dtype=torch.bfloat16)
        final = torch.zeros(0, d, dtype=torch.bfloat16)
        input_ids, loss_mask = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.uint8)
    data = store.ShardData(
        sample_ids=[s.sample_id for s in samples], splits=[s.split for s in samples],
        input_ids=input_ids, loss_mask=loss_mask,
        hidden=_bits(hidden), final_hidden=_bits(final), offsets=offsets, final_offsets=final_offsets)
    if storage_dtype == "fp8":
        hb, hs = fp8.quantize(hidden, m)
        fb, fs = fp8.quantize(final, 1)
        data.hidden, data.hidden_scale = hb.numpy(), hs.numpy()
        data.final_hidden, data.final_scale = fb.numpy(), fs.numpy()
    return data


class ShardWriter:
    """Bounded background writer: encodes and commits shards while the target computes the next."""

    def __init__(self, output_url: str, cfg: PipelineConfig, layers: list[int], target_meta: dict[str, Any],
                 stats: Stats, depth: int = 1) -> None:
        self.output_url, self.cfg, self.layers = output_url, cfg, layers
        self.meta, self.stats = target_meta, stats
        self.queue: queue.Queue[ShardJob | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="cache-writer", daemon=True)
        self.thread.start()

    def submit(self, job: ShardJob) -> None:
        if self.error is not None:
            raise self.error
        t0 = time.perf_counter()
        self.queue.put(job)
        self.stats.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            if self.error is not None:
                continue
            try:
                self._write(job)
            except BaseException as e:  # surfaced to the main thread on the next submit/close
                self.error = e

    def _write(self, job: ShardJob) -> None:
        t0 = time.perf_counter()
        c = self.cfg.cache
        d = self.meta["hidden_size"]
        data = assemble(job, c.storage_dtype, self.layers, d)
        attrs = {"shard_index": job.index, "layers": self.layers, "storage_dtype": c.storage_dtype}
        objects = store.encode_shard(data, c.storage_dtype, c.compression, CHUNK_TOKENS, attrs)
        n_tok, n_loss = int(data.offsets[-1]), int(data.final_offsets[-1])
        raw = store.layout_bytes(n_tok, n_loss, len(self.layers), d, c.storage_dtype)
        stored = sum(len(b) for b in objects.values())
        validation = [j for j, sp in enumerate(data.splits) if sp == "validation"]
        payload = {
            "index": job.index, "name": store.shard_name(job.index), "num_samples": len(job.samples),
            "num_tokens": n_tok, "num_loss_tokens": n_loss, "bytes": stored, "raw_bytes": raw,
            "checksums": store.checksums(objects), "validation_samples": validation,
            "skipped": job.skipped, "skipped_ids": job.skipped_ids, "target": self.meta,
        }
        store.write_shard(store.shard_url(self.output_url, job.index), objects, payload)
        self.stats.raw_bytes += raw
        self.stats.stored_bytes += stored
        self.stats.shards += 1
        self.stats.write_s += time.perf_counter() - t0


def target_meta(target: Target, cfg: PipelineConfig, layers: list[int]) -> dict[str, Any]:
    """What each shard records about the target (every worker must agree on it)."""
    return {"target": cfg.target.model, "target_config_hash": target.config_hash,
            "layers": layers, "hidden_size": target.hidden_size, "num_target_layers": target.num_layers,
            "vocab_size": target.vocab_size, "template_hash": target.template_hash}


def progress_line(shard: int, n: int, total: int, tokens: int, raw_bytes: int, stored_bytes: int,
                  elapsed: float) -> str:
    """One build progress line; the bytes and compression only once the writer has stored some
    (the first line used to say '0 B written, compression nan×')."""
    eta = elapsed / n * (total - n)
    written = ""
    if stored_bytes:
        written = f"{fmt_bytes(stored_bytes)} written, compression {raw_bytes / stored_bytes:.2f}×, "
    return (f"  shard {shard:5d} ({n}/{total}): {tokens / max(elapsed, 1e-9):,.0f} tok/s, {written}"
            f"ETA {eta:,.0f}s")


def build_cache(cfg: PipelineConfig, responses_url: str, output_url: str, force: bool = False,
                num_workers: int | None = None, worker_index: int | None = None,
                quiet: bool = False) -> StageResult:
    """Build (or resume) this worker's shards; finalize when all are committed.

    The summary holds this worker's figures (shards_built, tokens, seconds, bytes) and, once the
    manifest is written, `cache`: the figures `dspark cache inspect` shows. The manifest is None
    while other workers' shards are missing.
    """
    rank, world = worker_rank(num_workers, worker_index)
    if force and world > 1:
        raise DsparkError("--force with several workers would let each one delete the others' shards.",
                          hint="remove the output once (or run one worker with --force), then the rest.")
    manifest.require_artifact(responses_url, "data.regen", "--responses", RESPONSES_HINT)  # local first
    t = cfg.target
    layers = resolve_layers(t.layers, num_layers(load_config(t.model, t.revision, t.trust_remote_code)))
    run = manifest.prepare_stage(STAGE, output_url, stage_config(cfg, layers),
                                 {responses_url: manifest.fingerprint(responses_url)}, force=force)
    if run.state == "done":
        return already_done(run, lambda found: {"cache": cache_summary(output_url, found)})
    say = (lambda *a: None) if quiet else console.print
    if not storage.exists(storage.join(responses_url, manifest.MANIFEST_NAME)):
        say(f"[yellow]warning:[/] {responses_url} has no manifest.json: is `dspark data regen` still "
            "running? The cache covers only the rows present now.")
    rows = io.row_index(responses_url)  # footers only: each shard's rows are read when it is built
    if not rows.num_rows:
        raise DsparkError(f"{responses_url}: no responses to cache (0 rows).",
                          hint="run `dspark data regen` until it answers some prompts, or pass --input.")
    per = cfg.cache.samples_per_shard
    num_shards = -(-rows.num_rows // per)
    mine = [k for k in range(num_shards) if k % world == rank]
    todo = [k for k in mine if run.replaces or not storage.is_committed(store.shard_url(output_url, k))]
    # The target is loaded (the stage's probe) before the output is claimed: a wrong --target or
    # layer list leaves nothing that would refuse the corrected rerun.
    loaded = Target.from_settings(cfg.target) if todo else None
    run.claim()
    storage.write_json(storage.join(output_url, LAYOUT_NAME),
                       {"num_shards": num_shards, "num_rows": rows.num_rows, "samples_per_shard": per})
    _clean_own_temporaries(output_url, todo)
    say(f"cache: {rows.num_rows} samples in {num_shards} shards; worker {rank}/{world} owns {len(mine)}, "
        f"{len(mine) - len(todo)} already committed.")
    stats = Stats()
    if loaded is not None:
        model, tokenizer = loaded.model, loaded.tokenizer
        meta = target_meta(loaded, cfg, layers)
        writer = ShardWriter(output_url, cfg, layers, meta, stats)
        try:
            for n, k in enumerate(todo, 1):
                t0 = time.perf_counter()
                samples, skipped, skipped_ids = render_rows(
                    tokenizer, rows.read(k * per, (k + 1) * per, INPUT_COLUMNS), cfg.cache.max_length,
                    cfg.cache.min_loss_tokens)
                t1 = time.perf_counter()
                stats.tokens += forward_samples(model, samples, layers, cfg.cache.batch_tokens)
                t2 = time.perf_counter()
                stats.render_s += t1 - t0
                stats.forward_s += t2 - t1
                writer.submit(ShardJob(k, samples, skipped, skipped_ids))
                say(progress_line(k, n, len(todo), stats.tokens, stats.raw_bytes, stats.stored_bytes,
                                  time.time() - stats.started))
        finally:
            writer.close()
    summary: dict[str, Any] = {"worker": rank, "world": world, "shards_built": len(todo),
                               "tokens": stats.tokens, "forward_s": stats.forward_s, "write_s": stats.write_s,
                               "render_s": stats.render_s, "wait_s": stats.wait_s,
                               "stored_bytes": stats.stored_bytes, "raw_bytes": stats.raw_bytes,
                               "wall_s": time.time() - stats.started}
    final = finalize_cache(output_url, strict=False, started=run.started,
                           timings={"forward_seconds": stats.forward_s, "writer_seconds": stats.write_s})
    if final is None:
        say("cache: other workers' shards are still missing; the last one to finish (or "
            "`dspark cache finalize`) writes the manifest.")
    else:
        summary["cache"] = cache_summary(output_url, final)
    return completed(run, final, summary)


def _clean_own_temporaries(output_url: str, shards: list[int]) -> None:
    """Drop temporaries of this worker's unfinished shards only (other workers may be writing theirs)."""
    root = storage.join(output_url, store.SHARDS_DIR)
    prefixes = tuple(f"{storage.TMP_PREFIX}{store.shard_name(k)}-" for k in shards)
    for name in storage.listdir(root):
        if prefixes and name.startswith(prefixes):
            storage.remove(storage.join(root, name))


def finalize_cache(output_url: str, strict: bool = True, timings: dict[str, float] | None = None,
                   started: float | None = None) -> dict[str, Any] | None:
    """Write the manifest once every shard is committed; None (or an error when strict) otherwise.

    `started` is when the finishing worker began (its wall seconds go into the manifest); a
    standalone `dspark cache finalize` counts from the moment the build claimed the folder.
    """
    existing = manifest.read_manifest(output_url)
    if existing is not None:
        return existing
    run_url = storage.join(output_url, manifest.RUN_NAME)
    layout_url = storage.join(output_url, LAYOUT_NAME)
    if not storage.exists(run_url) or not storage.exists(layout_url):
        raise DsparkError(f"{output_url}: no cache build was started here.",
                          hint="run `dspark cache build` first.")
    spec = storage.read_json(run_url)
    layout = storage.read_json(layout_url)
    n = layout["num_shards"]
    missing = [k for k in range(n) if not storage.is_committed(store.shard_url(output_url, k))]
    if missing:
        if strict:
            shown = ", ".join(store.shard_name(k) for k in missing[:5]) + (" …" if len(missing) > 5 else "")
            raise DsparkError(f"{output_url}: {len(missing)} of {n} shards are not committed ({shown}).",
                              hint="run (or rerun) the `dspark cache build` workers that own them.")
        return None
    shards = [storage.read_json(storage.join(store.shard_url(output_url, k), storage.COMMIT_MARKER))
              for k in range(n)]
    config = spec["config"]
    meta = _agreed_target_meta(shards, config, output_url)
    skipped: dict[str, int] = {}
    for s in shards:
        for reason, count in s["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + count
    m, d = len(config["target"]["layers"]), meta["hidden_size"]
    tokens = sum(s["num_tokens"] for s in shards)
    stored = sum(s["bytes"] for s in shards)
    extra = {
        "format": "dspark-cache/v1", **meta, "layers": config["target"]["layers"],
        "storage_dtype": config["cache"]["storage_dtype"], "compression": config["cache"]["compression"],
        "max_length": config["cache"]["max_length"], "chunk_tokens": config["cache"]["chunk_tokens"],
        "num_samples": sum(s["num_samples"] for s in shards), "num_tokens": tokens,
        "num_loss_tokens": sum(s["num_loss_tokens"] for s in shards), "bytes": stored,
        "raw_bytes": sum(s["raw_bytes"] for s in shards),
        "reference_bytes": store.reference_bytes(tokens, m, d),
        "shards": [{k: s[k] for k in ("index", "name", "num_samples", "num_tokens", "num_loss_tokens",
                                      "bytes", "raw_bytes", "checksums", "validation_samples")}
                   for s in shards],
    }
    validate(extra, "cache_manifest", where=storage.join(output_url, manifest.MANIFEST_NAME))
    counts = {"samples": extra["num_samples"], "rows": layout["num_rows"], "skipped": skipped,
              "shards": n, "tokens": tokens, "loss_tokens": extra["num_loss_tokens"], "bytes": stored}
    inputs = spec["inputs"]
    run = manifest.StageRun(STAGE, output_url, config, inputs, "resume",
                            started=started or spec.get("claimed_at") or time.time())
    if not extra["num_samples"]:  # nothing to train on: never a finished cache
        run.abandon()
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items(), key=lambda kv: -kv[1])) or "-"
        raise StageFailed(f"cache build: all {layout['num_rows']} rows were skipped ({reasons}); "
                          "the cache would hold no sample.",
                          hint="raise cache.max_length or lower cache.min_loss_tokens, then rerun "
                               "(it starts afresh).")
    return run.finish(counts, extra=extra, timings=timings)


def _agreed_target_meta(shards: list[dict[str, Any]], config: dict[str, Any], url: str) -> dict[str, Any]:
    """Every worker must have seen the same target and template; refuse a mixed cache."""
    if not shards:
        return {"target": config["target"]["model"], "target_config_hash": "", "hidden_size": 0,
                "num_target_layers": 0, "vocab_size": 0, "template_hash": ""}
    first = shards[0]["target"]
    for s in shards[1:]:
        if s["target"] != first:
            diff = sorted(k for k in first if s["target"].get(k) != first[k])
            raise DsparkError(f"{url}: shard {s['name']} was built with a different target "
                              f"({', '.join(diff)}).",
                              hint="rebuild that shard (delete it) with the same --target on every worker.")
    return {k: v for k, v in first.items() if k != "layers"}
