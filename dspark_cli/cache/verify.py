"""`dspark cache verify` and `inspect`: re-read every shard against the manifest; summarise a cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import manifest, storage
from ..errors import DsparkError
from . import store


def read_cache_manifest(url: str) -> dict[str, Any]:
    """The manifest of a finished cache; one line when the folder is absent (a typo) or unfinished."""
    if not storage.exists(url):
        raise DsparkError(f"{url}: no such cache folder.",
                          hint="check the path (a typo?), or build it with `dspark cache build`.")
    found = manifest.read_manifest(url)
    if found is None or found.get("stage") != "cache":
        raise DsparkError(f"{url}: not a finished cache (no cache manifest.json).",
                          hint="run `dspark cache build`, or `dspark cache finalize` after all workers.")
    return found


def verify_cache(url: str, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Check every array of every shard (checksum, decode, shapes, counts); raise on the first bad one."""
    extra = read_cache_manifest(url)["extra"]
    d = extra["hidden_size"]
    width = d * len(extra["layers"])
    shards = extra["shards"]
    for n, shard in enumerate(shards, 1):
        shard_url = store.shard_url(url, shard["index"])
        problem = store.verify_shard(shard_url, shard, width, d, extra["storage_dtype"])
        if problem is not None:
            raise DsparkError(f"{url}: shard {shard['name']}: {problem}.",
                              hint=f"delete {store.SHARDS_DIR}/{shard['name']} and its manifest.json, then "
                                   "rerun `dspark cache build` to rebuild it.")
        if progress:
            progress(n, len(shards))
    return {"shards": len(shards), "samples": extra["num_samples"], "tokens": extra["num_tokens"],
            "bytes": extra["bytes"]}


def summary(url: str, found: dict[str, Any] | None = None) -> dict[str, Any]:
    """The figures `inspect` shows: what was captured, how big, against the reference layout
    (from `found`, the cache's manifest, when the caller holds it already)."""
    found = found if found is not None else read_cache_manifest(url)
    extra = found["extra"]
    tokens = max(1, extra["num_tokens"])
    return {
        "url": url, "target": extra["target"], "target_config_hash": extra["target_config_hash"][:16],
        "layers": extra["layers"], "hidden_size": extra["hidden_size"],
        "num_target_layers": extra["num_target_layers"], "storage_dtype": extra["storage_dtype"],
        "compression": extra["compression"], "max_length": extra["max_length"],
        "shards": len(extra["shards"]), "samples": extra["num_samples"], "tokens": extra["num_tokens"],
        "loss_tokens": extra["num_loss_tokens"], "skipped": found["counts"].get("skipped", {}),
        "bytes": extra["bytes"], "bytes_per_token": round(extra["bytes"] / tokens, 1),
        "reference_bytes_per_token": round(extra["reference_bytes"] / tokens, 1),
        "vs_reference": round(extra["bytes"] / max(1, extra["reference_bytes"]), 3),
        "compression_ratio": round(extra["raw_bytes"] / max(1, extra["bytes"]), 3),
    }
