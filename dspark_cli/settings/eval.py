"""[eval]: speculative decoding with the real target (`dspark eval`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import Section


@dataclass
class EvalSettings(Section):
    name = "eval"
    #: `{"turns": [...]}` JSONL files or prompt Parquet URLs.
    datasets: list[str] = field(default_factory=list)
    limit: int | None = None
    max_new_tokens: int = 256
    temperature: float = 1.0
    thinking: bool = False
    #: fixed, threshold, algorithm1 or async.
    schedule: str = "fixed"
    concurrency: int = 1

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            self.fail("max_new_tokens", f"must be > 0, got {self.max_new_tokens}.")
        if self.temperature < 0:
            self.fail("temperature", f"must be >= 0, got {self.temperature}.")
        if self.schedule not in ("fixed", "threshold", "algorithm1", "async"):
            self.fail("schedule", f"must be fixed, threshold, algorithm1 or async, got {self.schedule!r}.")
