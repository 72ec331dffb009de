"""SPS(B): the target's verification steps per second as a function of batch tokens B.

The scheduler maximises Θ = τ · SPS(B), so it needs SPS at any B: the table stores measured points
and `__call__` interpolates linearly between them (flat beyond the ends, since a table cannot say
what happens outside what was measured). `profile_target` measures the points on this hardware
with the decoder's own batched verification forward (decode/batch.py).

The file is SGLang's `SpsCostTable` (`--speculative-dspark-sps-table-path`): `sample_batch_tokens`
(strictly increasing), `sample_steps_per_sec`, `max_batch_tokens` (≥ the last probe), plus our
`schema_version` and `meta`, which SGLang ignores. SGLang looks up the floor probe rather than
interpolating. Files of the first release (`batch_tokens` / `steps_per_second`) still load.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import storage
from ..errors import DsparkError
from ..schemas import validate

if TYPE_CHECKING:  # torch loads only when a profile runs: the table itself is plain JSON
    import torch

SCHEMA = "sps_table"


@dataclass
class SpsTable:
    """Measured (batch tokens, steps/s) points, sorted by batch tokens."""

    batch_tokens: list[int]
    steps_per_second: list[float]
    meta: dict[str, Any] = field(default_factory=dict)
    #: The largest batch the table is meant for (SGLang sizes its verify budget by it).
    max_batch_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.batch_tokens or len(self.batch_tokens) != len(self.steps_per_second):
            raise DsparkError("SPS table needs equally many batch_tokens and steps_per_second, at least one.")
        order = sorted(range(len(self.batch_tokens)), key=self.batch_tokens.__getitem__)
        self.batch_tokens = [int(self.batch_tokens[i]) for i in order]
        self.steps_per_second = [float(self.steps_per_second[i]) for i in order]
        if any(b <= a for a, b in zip(self.batch_tokens, self.batch_tokens[1:], strict=False)):
            raise DsparkError(f"SPS table batch_tokens must be distinct, got {self.batch_tokens}.")
        if any(s <= 0 for s in self.steps_per_second):
            raise DsparkError("SPS table steps_per_second must all be > 0.")
        self.max_batch_tokens = max(int(self.max_batch_tokens), self.batch_tokens[-1])

    def __call__(self, batch_tokens: float) -> float:
        xs, ys = self.batch_tokens, self.steps_per_second
        if batch_tokens <= xs[0]:
            return ys[0]
        if batch_tokens >= xs[-1]:
            return ys[-1]
        i = bisect_left(xs, batch_tokens)
        if xs[i] == batch_tokens:
            return ys[i]
        frac = (batch_tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + frac * (ys[i] - ys[i - 1])

    @classmethod
    def constant(cls, steps_per_second: float = 1.0) -> SpsTable:
        """Compute-free hardware: Θ is then just τ (what a fixed schedule assumes)."""
        return cls([1], [steps_per_second], {"kind": "constant"})

    def to_dict(self) -> dict[str, Any]:
        """SGLang's SpsCostTable fields first; schema_version and meta are ours (SGLang ignores them)."""
        return {"sample_batch_tokens": self.batch_tokens, "sample_steps_per_sec": self.steps_per_second,
                "max_batch_tokens": self.max_batch_tokens, "schema_version": 2, "meta": self.meta}

    @classmethod
    def from_dict(cls, obj: dict[str, Any], where: str = "") -> SpsTable:
        """Either form: SGLang's (ours since v2, or written by SGLang's profiler) or our v1."""
        validate(obj, SCHEMA, where=where)
        meta = dict(obj.get("meta", {}))
        if "sample_batch_tokens" in obj:
            return cls(list(obj["sample_batch_tokens"]), list(obj["sample_steps_per_sec"]), meta,
                       int(obj["max_batch_tokens"]))
        return cls(list(obj["batch_tokens"]), list(obj["steps_per_second"]), meta)

    @classmethod
    def load(cls, url: str) -> SpsTable:
        return cls.from_dict(storage.read_json(url), where=url)

    def save(self, url: str) -> None:
        obj = self.to_dict()
        validate(obj, SCHEMA, where=url)
        storage.write_json(url, obj)


def default_batch_grid(max_tokens: int = 256) -> list[int]:
    """1, 2, 4, … up to max_tokens plus a few points between, where curves usually bend."""
    grid = {1}
    b = 2
    while b <= max_tokens:
        grid.update({b, b + b // 2})
        b *= 2
    return sorted(x for x in grid if x <= max_tokens)


def row_lengths(batch_tokens: int, tokens_per_row: int) -> list[int]:
    """B tokens as the decoder lays them out: ⌈B / tokens_per_row⌉ requests, lengths within one."""
    rows = -(-batch_tokens // tokens_per_row)
    return [batch_tokens // rows + (1 if r < batch_tokens % rows else 0) for r in range(rows)]


def profile_target(model: torch.nn.Module, batch_tokens: list[int], context_length: int = 128,
                   warmup: int = 2, repeats: int = 5, vocab_size: int | None = None,
                   seed: int = 0, tokens_per_row: int = 8) -> SpsTable:
    """Time one verification step of B tokens with the decoder's own batched forward.

    B tokens go to ⌈B / tokens_per_row⌉ requests (8 = a γ = 7 round: anchor + 7 drafts), each
    with a cached context of `context_length`, through `TargetBatch.forward` and the lm_head, as
    a round of `dspark eval --concurrency R` runs them. The median of `repeats` timings is kept;
    the new positions are dropped after every step so each sees the same context.
    """
    if tokens_per_row < 1:
        raise DsparkError(f"tokens_per_row must be >= 1, got {tokens_per_row}.")
    import torch  # here, not at module level: reading or writing an SpsTable needs no torch

    from .batch import TargetBatch

    device = next(model.parameters()).device
    vocab = vocab_size or model.config.vocab_size
    lm_head = model.get_output_embeddings()
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(seed)
        batch = TargetBatch(model, [0])
        sps: list[float] = []
        for b in sorted(batch_tokens):
            lengths = row_lengths(b, tokens_per_row)
            while batch.rows < len(lengths):  # B ascending: rows only ever get added
                batch.add(torch.randint(0, vocab, (context_length,), generator=gen).tolist())
            inputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
            times = []
            for i in range(warmup + repeats):
                _sync(device)
                t0 = time.perf_counter()
                _hidden, final = batch.forward(inputs, [context_length] * len(inputs))
                lm_head(final)
                _sync(device)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                batch.commit([0] * len(inputs))
            times.sort()
            sps.append(1.0 / times[len(times) // 2])
    meta = {"context_length": context_length, "repeats": repeats, "device": str(device),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "tokens_per_row": tokens_per_row}
    return SpsTable(sorted(batch_tokens), sps, meta)


def crop_cache(cache: object, length: int) -> None:
    """Keep the first `length` positions of a DynamicCache.

    `crop(-n)` (remove n from the end) means the same in every Transformers version; a positive
    absolute length is refused by Transformers 5.
    """
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
