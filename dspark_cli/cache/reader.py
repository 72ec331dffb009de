"""Training reader: a PyTorch dataset over a finished cache on any fsspec URL.

    ds = CacheDataset("s3://bucket/cache", expect_layers=[1, 9, 17, 25, 33], split="train")
    sample = ds[0]   # a Sample: input_ids [T], loss_mask [T], hidden_states [T, m*d], final_hidden [K, d]

Opened shards stay in an LRU (their Zarr handles and per-token arrays, ~5 bytes a token); each
sample is a ranged read of its own rows. A background thread prefetches the next samples of the
iteration order, which `ShardLocalSampler` makes shard-local (shuffle shards, then samples within a
shard) so reads stay close together on object stores. With `memory_mb`, decoded samples are kept
up to that many MB, so a cache that fits is read once, not once per epoch: on 2 cores a demo
sample cost ~10 ms of decoding and a shard reopen ~190 ms, work that ran in the prefetch threads
beside every training step.

Every chunk read is checked against its crc32c as zarr decodes it (`store.CHUNK_CHECKSUM`); a
chunk that fails, or does not decode at all, stops the read with one line naming the shard and
the array. A cache built before per-chunk checksums reads unverified, which is said once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .. import storage
from ..console import console
from ..errors import DsparkError
from ..sample import Sample
from . import fp8, store
from .verify import read_cache_manifest


def _bf16(bits: np.ndarray) -> torch.Tensor:
    """uint16 bf16 bits → bfloat16 tensor, bit for bit."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


class _BadChunk(Exception):
    """A read of `array` failed: a checksum mismatch or bytes that do not decode."""

    def __init__(self, array: str, cause: BaseException) -> None:
        super().__init__(array)
        self.array, self.cause = array, cause

    def reason(self) -> str:
        text = str(self.cause).splitlines()[0] if str(self.cause) else type(self.cause).__name__
        if "checksum" in text.lower():
            return "a chunk fails its checksum"
        return f"a chunk does not decode: {text[:120]}"


def _read_all(arrays: dict[str, Any], rows: list[tuple[int, int]] | None = None) -> list[np.ndarray]:
    """Read row ranges of several named arrays concurrently (one round trip's latency on object
    stores); _BadChunk naming the array when one fails to verify or decode."""
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    async def one(name: str, sel: tuple[int, int] | None) -> np.ndarray:
        index = slice(None) if sel is None else slice(*sel)
        try:
            return await arrays[name]._async_array.getitem(index, prototype=default_buffer_prototype())
        except Exception as e:  # noqa: BLE001 - zarr/numcodecs raise many types for bad bytes
            raise _BadChunk(name, e) from e

    async def gather() -> list[np.ndarray]:
        return list(await asyncio.gather(*(one(name, sel) for name, sel in
                                           zip(arrays, rows or [None] * len(arrays), strict=True))))

    return [np.asarray(x) for x in sync(gather())]


class _Shard:
    """An opened shard: Zarr arrays plus its (small) offsets and per-sample ids."""

    def __init__(self, url: str) -> None:
        try:
            self.arrays, attrs = store.shard_arrays(url)
        except Exception as e:  # noqa: BLE001 - unreadable metadata, whatever zarr raises for it
            raise _BadChunk("zarr.json", e) from e
        self.verified = all(store.chunk_checksummed(arr) for arr in self.arrays.values())
        # The small per-token arrays (5 bytes/token) are read whole once; states per sample.
        self.offsets, self.final_offsets, self.input_ids, self.loss_mask = _read_all(
            {name: self.arrays[name] for name in store.INDEX_ARRAYS})
        self.sample_ids: list[str] = list(attrs["sample_ids"])


class CacheDataset(torch.utils.data.Dataset):
    """One sample per item; refuses a cache built for other layers, width or target."""

    def __init__(self, url: str, expect_layers: list[int] | None = None,
                 expect_hidden_size: int | None = None, expect_target_config_hash: str | None = None,
                 split: str | None = None, lru_shards: int = 64, prefetch: int = 8,
                 memory_mb: int = 0) -> None:
        self.url = url
        found = read_cache_manifest(url)
        self.meta: dict[str, Any] = found["extra"]
        self._check(expect_layers, expect_hidden_size, expect_target_config_hash)
        self.storage_dtype = self.meta["storage_dtype"]
        self.hidden_size = int(self.meta["hidden_size"])
        shards = self.meta["shards"]
        self._check_shards_present([store.shard_name(s["index"]) for s in shards])
        # Global index, in shard order: sample i is sample `_within[i]` of shard `_shard_of[i]`.
        # NumPy arrays (9 bytes a sample), not lists of tuples: start-up memory stays flat with
        # the cache's size (a 1.4M-sample cache costs ~13 MB here, not ~150 MB).
        counts = np.array([s["num_samples"] for s in shards], dtype=np.int64)
        shard_of = np.repeat(np.array([s["index"] for s in shards], dtype=np.int32), counts)
        within = (np.arange(int(counts.sum()), dtype=np.int64)
                  - np.repeat(np.cumsum(counts) - counts, counts)).astype(np.int32)
        held_out = np.zeros(len(within), dtype=bool)
        first = 0
        for s, n in zip(shards, counts.tolist(), strict=True):
            held_out[[first + j for j in s["validation_samples"] if j < n]] = True
            first += n
        if split is not None:
            keep = held_out if split == "validation" else ~held_out
            shard_of, within, held_out = shard_of[keep], within[keep], held_out[keep]
        self._shard_of, self._within, self._held_out = shard_of, within, held_out
        self.split = split
        self.lru_shards = lru_shards
        self.prefetch = prefetch
        #: Decoded samples kept (first come, never evicted) up to this many bytes; 0 keeps none.
        self.memory_bytes = max(0, int(memory_mb)) * 2**20
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._unverified_said = False
        self._lru: OrderedDict[int, _Shard] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self._order: np.ndarray | None = None
        self._pos: np.ndarray | None = None
        self._kept: dict[int, Sample] = {}
        self._kept_bytes = 0

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers: reopen handles lazily
        state = self.__dict__.copy()
        for key in ("_lru", "_lock", "_pool", "_pending", "_order", "_pos", "_unverified_said",
                    "_kept", "_kept_bytes"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def _check(self, layers: list[int] | None, hidden: int | None, config_hash: str | None) -> None:
        meta = self.meta
        if layers is not None and list(layers) != list(meta["layers"]):
            raise DsparkError(f"{self.url}: cache holds layers {meta['layers']}, "
                              f"training expects {list(layers)}.",
                              hint="rebuild the cache with those --layers or set target.layers to match.")
        if hidden is not None and int(hidden) != int(meta["hidden_size"]):
            raise DsparkError(f"{self.url}: cache hidden size is {meta['hidden_size']}, expected {hidden}.")
        if config_hash is not None and config_hash != meta["target_config_hash"]:
            built_for = meta.get("target") or "?"
            raise DsparkError(f"{self.url}: the cache was built for another target ({built_for}; config "
                              f"hash {meta['target_config_hash'][:12]}…, expected {config_hash[:12]}…).")

    def _check_shards_present(self, names: list[str]) -> None:
        """Every shard the manifest lists is there (one listing, before the first step): a deleted
        shard folder is missing, not corrupt, and is found before training starts."""
        present = set(storage.listdir(storage.join(self.url, store.SHARDS_DIR)))
        missing = [name for name in names if name not in present]
        if missing:
            raise DsparkError(f"{self.url}: shard {missing[0]} is missing ({len(missing)} of {len(names)} "
                              "shards the cache manifest lists are not there).",
                              hint="restore the shard folder, or rebuild the cache "
                                   "(`dspark cache build … --force`).")

    def __len__(self) -> int:
        return len(self._within)

    def split_of(self, i: int) -> str:
        return "validation" if self._held_out[i] else "train"

    def shard_of(self, i: int) -> int:
        """The shard index holding sample i."""
        return int(self._shard_of[i])

    @property
    def layers(self) -> list[int]:
        return list(self.meta["layers"])

    def _shard(self, k: int) -> _Shard:
        with self._lock:
            if k in self._lru:
                self._lru.move_to_end(k)
                return self._lru[k]
        opened = _Shard(store.shard_url(self.url, k))
        if not opened.verified and not self._unverified_said:
            self._unverified_said = True
            console.print(f"[yellow]warning:[/] {self.url} was built without per-chunk checksums: its reads "
                          "are not verified (`dspark cache verify` checks it whole).")
        with self._lock:
            self._lru[k] = opened
            while len(self._lru) > self.lru_shards:
                self._lru.popitem(last=False)
        return opened

    def _load(self, i: int) -> Sample:
        k, j = int(self._shard_of[i]), int(self._within[i])
        try:
            return self._read(k, j, i)
        except _BadChunk as e:
            raise DsparkError(f"{self.url}: shard {store.shard_name(k)}: array '{e.array}' is corrupt "
                              f"({e.reason()}).", hint=f"run `dspark cache verify {self.url}`, then "
                                                       "rebuild the shard it names.") from None

    def _read(self, k: int, j: int, i: int) -> Sample:
        shard = self._shard(k)
        a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
        fa, fb = int(shard.final_offsets[j]), int(shard.final_offsets[j + 1])
        arrays = shard.arrays
        input_ids = torch.from_numpy(shard.input_ids[a:b].astype(np.int64))
        loss_mask = torch.from_numpy(shard.loss_mask[a:b].astype(bool))
        if self.storage_dtype == "fp8":
            names = ("hidden", "hidden_scale", "final_hidden", "final_scale")
            hb, hs, fb_, fs = _read_all({n: arrays[n] for n in names}, [(a, b), (a, b), (fa, fb), (fa, fb)])
            hidden = fp8.dequantize(torch.from_numpy(hb), torch.from_numpy(hs))
            final_rows = fp8.dequantize(torch.from_numpy(fb_), torch.from_numpy(fs))
        else:
            hb, fb_ = _read_all({n: arrays[n] for n in ("hidden", "final_hidden")}, [(a, b), (fa, fb)])
            hidden = _bf16(hb)  # [T, m*d]
            final_rows = _bf16(fb_)  # [K, d]
        return Sample(shard.sample_ids[j], input_ids, loss_mask, hidden, final_rows, split=self.split_of(i))

    def split_token_counts(self, vocab: int, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Counts [vocab] of this split's response (loss-masked) tokens and of its other tokens
        (prompts, template), shard by shard from the index arrays alone (no hidden states read),
        until at least `max_tokens` response tokens were counted."""
        response = np.zeros(vocab, dtype=np.int64)
        context = np.zeros(vocab, dtype=np.int64)
        seen = 0
        for k in dict.fromkeys(self._shard_of.tolist()):  # shards in order, each once
            try:
                shard = self._shard(k)
            except _BadChunk as e:
                raise DsparkError(f"{self.url}: shard {store.shard_name(k)}: array '{e.array}' is corrupt "
                                  f"({e.reason()}).") from None
            chosen = np.zeros(len(shard.offsets) - 1, dtype=bool)
            chosen[self._within[self._shard_of == k]] = True
            in_split = np.repeat(chosen, np.diff(shard.offsets))
            is_response = shard.loss_mask.astype(bool)
            ids = shard.input_ids[in_split & is_response].astype(np.int64)
            response += np.bincount(ids, minlength=vocab)[:vocab]
            context += np.bincount(shard.input_ids[in_split & ~is_response].astype(np.int64),
                                   minlength=vocab)[:vocab]
            seen += ids.size
            if seen >= max_tokens:
                break
        return response, context

    def set_order(self, order: Sequence[int] | torch.Tensor | np.ndarray) -> None:
        """Tell the prefetcher the iteration order (a sampler's indices, each at most once): kept
        as arrays, the order and each sample's place in it (16 bytes a sample)."""
        self._order = np.asarray(order, dtype=np.int64)
        self._pos = np.full(len(self), -1, dtype=np.int64)
        self._pos[self._order] = np.arange(len(self._order))

    def _schedule(self, i: int) -> None:
        if self.prefetch <= 0:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cache-prefetch")
        if self._order is not None and self._pos[i] >= 0:
            p = int(self._pos[i])
            nxt = self._order[p + 1:p + 1 + self.prefetch].tolist()
        else:
            nxt = list(range(i + 1, min(len(self), i + 1 + self.prefetch)))
        with self._lock:
            for n in nxt:
                if n not in self._pending and n not in self._kept:
                    self._pending[n] = self._pool.submit(self._load, n)

    def __getitem__(self, i: int) -> Sample:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range (cache has {len(self)})")
        with self._lock:
            kept = self._kept.get(i)
            pending = self._pending.pop(i, None)
            if len(self._pending) > 4 * max(1, self.prefetch):  # a random-access user: drop stale work
                self._pending.clear()
        if kept is not None:
            self._schedule(i)
            return kept
        try:
            item = pending.result() if pending is not None else self._load(i)
        except DsparkError:
            self.close()  # a corrupt chunk ends the run: leave no prefetch behind
            raise
        self._keep(i, item)
        self._schedule(i)
        return item

    def _keep(self, i: int, item: Sample) -> None:
        """Hold a decoded sample while the memory budget lasts (readers never modify samples)."""
        if self._kept_bytes >= self.memory_bytes:  # no budget, or spent: nothing to weigh
            return
        size = item.nbytes
        with self._lock:
            if i not in self._kept and self._kept_bytes + size <= self.memory_bytes:
                self._kept[i] = item
                self._kept_bytes += size

    @property
    def kept_samples(self) -> int:
        """How many decoded samples are held in memory (`memory_mb`)."""
        return len(self._kept)

    def close(self) -> None:
        """Stop the prefetcher (queued reads are dropped); the dataset still reads on demand."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._pending.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class ShardLocalSampler(torch.utils.data.Sampler[int]):
    """Shuffle shards, then samples inside each shard: random enough, and reads stay shard-local."""

    def __init__(self, dataset: CacheDataset, seed: int = 0) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        by_shard: dict[int, list[int]] = {}
        for i in range(len(self.dataset)):
            by_shard.setdefault(self.dataset.shard_of(i), []).append(i)
        shards = list(by_shard)
        order: list[int] = []
        for s in torch.randperm(len(shards), generator=gen).tolist():
            members = by_shard[shards[s]]
            order += [members[p] for p in torch.randperm(len(members), generator=gen).tolist()]
        self.dataset.set_order(order)
        return iter(order)

