"""[data]: prompt preparation (`dspark data prepare`)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section


@dataclass
class DataSettings(Section):
    name = "data"
    input_paths = {"source": "source"}
    #: Hugging Face dataset id, or local JSONL / JSON / Parquet file(s) (comma-separated or glob).
    source: str = "mlabonne/open-perfectblend"
    #: Dataset split when `source` is a hub dataset.
    split: str = "train"
    #: Fraction of conversations held out for validation (calibration uses them).
    val_fraction: float = 0.05
    #: Seed of the train/validation split.
    seed: int = 0
    #: Keep only the first N usable conversations (None: all).
    limit: int | None = None
    #: Rows per output Parquet shard.
    shard_rows: int = 10000

    def validate(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            self.fail("val_fraction", f"must be in [0, 1), got {self.val_fraction}.")
        if self.limit is not None and self.limit <= 0:
            self.fail("limit", f"must be > 0, got {self.limit}.")
        if self.shard_rows <= 0:
            self.fail("shard_rows", f"must be > 0, got {self.shard_rows}.")
