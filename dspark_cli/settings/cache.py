"""[cache]: target hidden-state cache (`dspark cache build`)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section


@dataclass
class CacheSettings(Section):
    name = "cache"
    #: Tokens per sample after rendering; longer samples are truncated.
    max_length: int = 4096
    #: Samples with fewer supervised (loss-mask) tokens are skipped and counted.
    min_loss_tokens: int = 16
    #: bf16 (lossless) or fp8 (e4m3 with a per-token, per-layer scale).
    storage_dtype: str = "bf16"
    #: Codec of the hidden-state arrays: blosc (byte-shuffle + zstd-3, chosen by measurement on
    #: SmolLM2 states, see docs/cache.md), zstd (zstd-3) or none.
    compression: str = "blosc"
    #: Samples per shard (one Zarr group, committed atomically; the unit of resume and of
    #: multi-worker splitting). Host memory holds up to three shards' states at once.
    samples_per_shard: int = 64
    #: Token budget of one target forward batch (only equal-length samples share a batch, so the
    #: stored states are bit-identical to a single-sequence forward).
    batch_tokens: int = 16384

    def validate(self) -> None:
        if self.max_length <= 1:
            self.fail("max_length", f"must be > 1, got {self.max_length}.")
        if self.min_loss_tokens < 2:
            self.fail("min_loss_tokens", f"must be >= 2, got {self.min_loss_tokens}.")
        if self.storage_dtype not in ("bf16", "fp8"):
            self.fail("storage_dtype", f"must be bf16 or fp8, got {self.storage_dtype!r}.")
        if self.compression not in ("zstd", "blosc", "none"):
            self.fail("compression", f"must be zstd, blosc or none, got {self.compression!r}.")
        if self.samples_per_shard <= 0:
            self.fail("samples_per_shard", f"must be > 0, got {self.samples_per_shard}.")
        if self.batch_tokens <= 0:
            self.fail("batch_tokens", f"must be > 0, got {self.batch_tokens}.")
