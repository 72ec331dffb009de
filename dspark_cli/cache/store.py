"""The cache's Zarr v3 layout: encode a shard, commit it atomically, open it, verify its checksums.

    {url}/shards/shard-00000/        one Zarr group of whole samples, committed by `_COMMITTED`
        input_ids      int32  [N]            token-major over the shard's samples
        loss_mask      uint8  [N]
        hidden         uint16 [N, m*d]       bf16 bits (attr logical_dtype) | uint8 e4m3 bits (fp8)
        hidden_scale   float16 [N, m]        fp8 only: one scale per token per layer
        final_hidden   uint16 [K, d]         only where loss_mask is 1 (K = its sum)
        final_scale    float16 [K, 1]        fp8 only
        offsets        int64  [n+1]          sample s is rows offsets[s]:offsets[s+1]
        final_offsets  int64  [n+1]          its final_hidden rows
    {url}/manifest.json                      stage manifest; `extra` per schemas/cache_manifest

Each array is one object (the sharding codec) of `chunk_tokens`-row inner chunks, so one
sample's rows come back with a ranged read without its neighbours' chunks; the arrays a reader
reads whole when it opens a shard (`INDEX_ARRAYS`) are one inner chunk each. Each inner chunk ends
in a crc32c of its encoded bytes (zarr's `crc32c` codec), checked whenever it is decoded; the
manifest's sha256 per array is what `dspark cache verify` checks whole. A shard is encoded in
memory, then written: locally to a temporary directory that is renamed into place after its
marker is written; on object stores straight to its prefix with the marker written last.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import posixpath
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ShardingCodec, ZstdCodec

from .. import storage
from ..errors import DsparkError

SHARDS_DIR = "shards"
SHARD_FORMAT = "dspark-cache-shard/v1"
ARRAYS_BF16 = ("input_ids", "loss_mask", "hidden", "final_hidden", "offsets", "final_offsets")
ARRAYS_FP8 = ARRAYS_BF16 + ("hidden_scale", "final_scale")
#: Append a crc32c to every inner chunk, which zarr checks on each decode (so the reader verifies
#: exactly the chunks it reads). Caches from before it lack them and read unverified.
CHUNK_CHECKSUM = True
#: The arrays a reader reads whole when it opens a shard (its index of the samples; 5 bytes/token).
INDEX_ARRAYS = ("offsets", "final_offsets", "input_ids", "loss_mask")
#: Write each index array as one inner chunk. In 64-row chunks a demo shard's open decoded ~600 tiny
#: chunks of them (~190 ms for every reopen under a shuffled epoch). Shards written before this read
#: the same.
WHOLE_INDEX = True


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def shard_url(url: str, index: int) -> str:
    return storage.join(url, SHARDS_DIR, shard_name(index))


def compressors(kind: str, typesize: int) -> list[Any]:
    """zstd: plain zstd-3. blosc: byte-shuffle then zstd-3 (groups the bf16 exponent bytes)."""
    if kind == "none":
        return []
    if kind == "zstd":
        return [ZstdCodec(level=3)]
    if kind == "blosc":
        return [BloscCodec(cname="zstd", clevel=3, shuffle="shuffle" if typesize > 1 else "noshuffle",
                           typesize=typesize, blocksize=0)]
    raise DsparkError(f"cache.compression {kind!r}: must be zstd, blosc or none.")


def layout_bytes(tokens: int, loss_tokens: int, m: int, d: int, storage_dtype: str) -> int:
    """Uncompressed bytes of this layout: ids + mask per token, m layers per token (plus their
    scales in fp8), the final state per loss token. What build records and estimate predicts."""
    if storage_dtype == "fp8":
        return tokens * (4 + 1 + m * d + 2 * m) + loss_tokens * (d + 2)
    return tokens * (4 + 1 + 2 * m * d) + loss_tokens * 2 * d


def reference_bytes(tokens: int, m: int, d: int) -> int:
    """The reference layout's bytes (ids, mask, m layers and the final state per token, bf16)."""
    return tokens * (6 + 2 * d * (m + 1))


@dataclass
class ShardData:
    """One shard's samples, already concatenated token-major (numpy, storage dtypes)."""

    sample_ids: list[str]
    splits: list[str]
    input_ids: np.ndarray  # int32 [N]
    loss_mask: np.ndarray  # uint8 [N]
    hidden: np.ndarray  # uint16|uint8 [N, m*d]
    final_hidden: np.ndarray  # uint16|uint8 [K, d]
    offsets: np.ndarray  # int64 [n+1]
    final_offsets: np.ndarray  # int64 [n+1]
    hidden_scale: np.ndarray | None = None  # float16 [N, m]
    final_scale: np.ndarray | None = None  # float16 [K, 1]


def encode_shard(data: ShardData, storage_dtype: str, compression: str, chunk_tokens: int,
                 attrs: dict[str, Any]) -> dict[str, bytes]:
    """Write the shard as a Zarr group into memory; return {key: bytes} ready to upload."""
    mem = zarr.storage.MemoryStore()
    group = zarr.open_group(store=mem, mode="w", zarr_format=3)
    group.attrs.update({"format": SHARD_FORMAT, "sample_ids": data.sample_ids, "splits": data.splits,
                        **attrs})
    logical = "bfloat16" if storage_dtype == "bf16" else "float8_e4m3fn"
    arrays: dict[str, tuple[np.ndarray, str | None]] = {
        "input_ids": (data.input_ids, None), "loss_mask": (data.loss_mask, None),
        "hidden": (data.hidden, logical), "final_hidden": (data.final_hidden, logical),
        "offsets": (data.offsets, None), "final_offsets": (data.final_offsets, None),
    }
    if storage_dtype == "fp8":
        arrays["hidden_scale"] = (data.hidden_scale, None)
        arrays["final_scale"] = (data.final_scale, None)
    for name, (values, logical_dtype) in arrays.items():
        rows = max(1, values.shape[0])
        whole = WHOLE_INDEX and name in INDEX_ARRAYS
        inner = (rows if whole else min(chunk_tokens, rows),) + values.shape[1:]
        outer = (-(-rows // inner[0]) * inner[0],) + values.shape[1:]  # whole array in one object
        kind = compression if name in ("hidden", "final_hidden") else "zstd"
        codecs = compressors(kind, values.dtype.itemsize) + ([Crc32cCodec()] if CHUNK_CHECKSUM else [])
        arr = group.create_array(name, shape=values.shape, dtype=values.dtype, chunks=inner, shards=outer,
                                 compressors=codecs, fill_value=0)
        if logical_dtype:
            arr.attrs["logical_dtype"] = logical_dtype
        if values.size:
            arr[...] = values

    async def _dump() -> dict[str, bytes]:
        out = {}
        async for key in mem.list():
            buf = await mem.get(key, prototype=zarr.core.buffer.default_buffer_prototype())
            out[key] = buf.to_bytes()
        return out

    return asyncio.run(_dump())


def checksums(objects: dict[str, bytes]) -> dict[str, str]:
    """sha256 per array (its metadata and chunk objects, in key order) plus the group metadata."""
    by_array: dict[str, hashlib._Hash] = {}
    for key in sorted(objects):
        if key.startswith(".") or posixpath.basename(key) == storage.COMMIT_MARKER:
            continue
        name = key.split("/", 1)[0] if "/" in key else "group"
        digest = by_array.setdefault(name, hashlib.sha256())
        digest.update(key.encode() + b"\0")
        digest.update(hashlib.sha256(objects[key]).digest())
    return {k: v.hexdigest() for k, v in sorted(by_array.items())}


def write_shard(url: str, objects: dict[str, bytes], payload: dict[str, Any]) -> None:
    """Commit a shard: every object, then the marker; locally a temp dir renamed into place."""
    fs, path = storage.url_to_fs(url)
    if storage.is_local(fs):
        parent, name = posixpath.split(path.rstrip("/"))
        tmp = posixpath.join(parent, f"{storage.TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
        try:
            for key, blob in objects.items():
                os.makedirs(posixpath.dirname(posixpath.join(tmp, key)), exist_ok=True)
                with open(posixpath.join(tmp, key), "wb") as f:
                    f.write(blob)
            storage.commit(tmp, payload)
        except BaseException:  # a full disk, an interrupt: no temporary shard left behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if os.path.exists(path):  # a partial shard from an older layout or a killed object-store-style write
            storage.remove(path)
        os.rename(tmp, path)
        return
    storage.remove(url)
    for key, blob in objects.items():
        storage.write_bytes(storage.join(url, key), blob)
    storage.commit(url, payload)


def read_objects(url: str) -> dict[str, bytes]:
    """Every stored object of a shard (relative key → bytes), the marker excluded."""
    fs, path = storage.url_to_fs(url)
    path = path.rstrip("/")
    out = {}
    for full in fs.find(path):
        key = full[len(path):].lstrip("/")
        if posixpath.basename(key) == storage.COMMIT_MARKER:
            continue
        with fs.open(full, "rb") as f:
            out[key] = f.read()
    return out


def zarr_store(url: str, read_only: bool = True) -> Any:
    """A Zarr store for any fsspec URL (local paths get zarr's LocalStore)."""
    fs, path = storage.url_to_fs(url)
    if storage.is_local(fs):
        return zarr.storage.LocalStore(path, read_only=read_only)
    options: dict[str, Any] = {}
    if url.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
    return zarr.storage.FsspecStore.from_url(url, storage_options=options or None, read_only=read_only)


def open_shard(url: str) -> zarr.Group:
    return zarr.open_group(store=zarr_store(url), mode="r", zarr_format=3)


def shard_arrays(url: str) -> tuple[dict[str, zarr.Array], dict[str, Any]]:
    """A shard's arrays by name and its group attributes."""
    group = open_shard(url)
    attrs = dict(group.attrs)
    # Opened by name, not listed: listing would trip over the commit marker inside the group.
    names = ARRAYS_FP8 if attrs.get("storage_dtype") == "fp8" else ARRAYS_BF16
    return {name: group[name] for name in names}, attrs


def chunk_checksummed(arr: zarr.Array) -> bool:
    """Whether each inner chunk of `arr` carries a crc32c that zarr checks on decode."""
    for codec in arr.metadata.codecs:
        inner = codec.codecs if isinstance(codec, ShardingCodec) else (codec,)
        if any(isinstance(c, Crc32cCodec) for c in inner):
            return True
    return False


def verify_shard(url: str, expected: dict[str, Any], width: int, d: int, storage_dtype: str) -> str | None:
    """Return None when the shard is intact, else one sentence naming the bad array."""
    if not storage.is_committed(url):
        return "not committed"
    got = checksums(read_objects(url))
    for name, digest in expected["checksums"].items():
        if got.get(name) != digest:
            return (f"array '{name}' checksum mismatch "
                    f"(expected {digest[:12]}…, got {str(got.get(name))[:12]}…)")
    try:
        group, _attrs = shard_arrays(url)
        n, N, K = expected["num_samples"], expected["num_tokens"], expected["num_loss_tokens"]
        shapes = {"input_ids": (N,), "loss_mask": (N,), "hidden": (N, width), "final_hidden": (K, d),
                  "offsets": (n + 1,), "final_offsets": (n + 1,)}
        if storage_dtype == "fp8":
            shapes.update(hidden_scale=(N, width // d), final_scale=(K, 1))
        for name, shape in shapes.items():
            if tuple(group[name].shape) != shape:
                return f"array '{name}' has shape {tuple(group[name].shape)}, manifest says {shape}"
        offsets = group["offsets"][...]
        if int(offsets[-1]) != N or int(group["loss_mask"][...].sum()) != K:
            return "array 'offsets' or 'loss_mask' disagrees with the manifest counts"
    except Exception as e:  # a corrupt chunk fails to decode
        return f"cannot decode ({type(e).__name__}: {e})"
    return None
