"""What verifying every chunk costs the training reader: reads with per-chunk crc32c against the
same shards without it (the layout of caches built before it).

Shards at SmolLM2-135M's size (5 layers of hidden 576, bf16, blosc) are filled with synthetic
states, once with `store.CHUNK_CHECKSUM` on and once off; then every sample is read through the
reader's own path (`_Shard`, `_read_all`) `--repeats` times and the fastest pass is kept.
Synthetic states compress worse than real ones, so there are more bytes to checksum per token
than in a real cache: an upper bound on the cost.

    .venv/bin/python benchmarks/bench_cache_verify.py --samples 32 --tokens 512
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import google_crc32c
import numpy as np
import torch

from dspark_cli.cache import store
from dspark_cli.cache.reader import _read_all, _Shard


def shard_data(samples: int, tokens: int, m: int, d: int, seed: int) -> store.ShardData:
    gen = torch.Generator().manual_seed(seed)
    n = samples * tokens
    hidden = (torch.randn(n, m * d, generator=gen) * 0.5).to(torch.bfloat16)
    mask = np.tile((np.arange(tokens) >= tokens // 4).astype(np.uint8), samples)
    k = int(mask.sum())
    final = (torch.randn(k, d, generator=gen) * 0.5).to(torch.bfloat16)
    bits = lambda x: x.contiguous().view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    return store.ShardData(
        sample_ids=[f"s{i}" for i in range(samples)], splits=["train"] * samples,
        input_ids=np.arange(n, dtype=np.int32) % 49152, loss_mask=mask, hidden=bits(hidden),
        final_hidden=bits(final), offsets=np.arange(0, n + 1, tokens, dtype=np.int64),
        final_offsets=np.arange(0, k + 1, k // samples, dtype=np.int64))


def read_every_sample(url: str) -> float:
    t0 = time.perf_counter()
    shard = _Shard(url)
    for j in range(len(shard.sample_ids)):
        a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
        fa, fb = int(shard.final_offsets[j]), int(shard.final_offsets[j + 1])
        _read_all({n: shard.arrays[n] for n in ("hidden", "final_hidden")}, [(a, b), (fa, fb)])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--samples", type=int, default=32, help="Samples per shard.")
    ap.add_argument("--tokens", type=int, default=512, help="Tokens per sample.")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compression", default="blosc", choices=["blosc", "zstd", "none"])
    args = ap.parse_args()
    m, d = 5, 576
    with tempfile.TemporaryDirectory() as tmp:
        urls: dict[bool, list[str]] = {True: [], False: []}
        for checked in (True, False):
            store.CHUNK_CHECKSUM = checked
            for k in range(args.shards):
                data = shard_data(args.samples, args.tokens, m, d, seed=k)
                objects = store.encode_shard(data, "bf16", args.compression, 64, {"storage_dtype": "bf16"})
                url = str(Path(tmp) / f"{'crc' if checked else 'plain'}" / store.shard_name(k))
                store.write_shard(url, objects, {"index": k})
                urls[checked].append(url)
        store.CHUNK_CHECKSUM = True
        best = {True: float("inf"), False: float("inf")}
        for _ in range(args.repeats):  # interleaved, so a busy moment does not favour one side
            for checked in (False, True):
                best[checked] = min(best[checked], sum(read_every_sample(u) for u in urls[checked]))
        tokens = args.shards * args.samples * args.tokens
        mb = tokens * (4 + 1 + 2 * m * d) / 1e6
        for checked in (False, True):
            name = "with crc32c" if checked else "unverified "
            rate = mb / best[checked]
            print(f"{name}: {best[checked]:.3f} s for {tokens:,} tokens ({rate:,.0f} MB/s of states)")
        print(f"verification cost: {100 * (best[True] / best[False] - 1):+.1f}% of read time (end to end)")
        blobs = [p.read_bytes() for u in urls[True] for p in Path(u).rglob("*") if p.is_file()]
        t0 = time.perf_counter()
        for blob in blobs:
            google_crc32c.value(blob)
        crc = time.perf_counter() - t0
        print(f"crc32c alone over every stored byte ({sum(map(len, blobs)) / 1e6:,.0f} MB): {crc:.3f} s = "
              f"{100 * crc / best[True]:.1f}% of the verified read time")


if __name__ == "__main__":
    main()
