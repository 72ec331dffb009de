"""Continuous-ish batching: one worker thread runs batches; requests that arrive meanwhile join
the next one, so concurrent clients share forward passes.

The worker waits for a first sequence, then gives late arrivals `wait_ms` to join, takes what is
queued up to `max_batch_size` sequences and `max_batch_tokens` padded prompt tokens, and runs the
batch; between two decoding steps, sequences queued meanwhile join the running batch while it has
room (finished rows leave the KV cache at once). Counters feed `/health`.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import asdict, dataclass

from ..console import console
from .engine import Engine, Sequence


@dataclass
class Stats:
    """Counters shown by /health: enough to tell that batches of several requests formed."""

    requests: int = 0
    sequences: int = 0
    batches: int = 0
    max_batch_size: int = 0
    #: Sequences that joined a batch already running (continuous batching).
    joined: int = 0
    forward_passes: int = 0
    #: Sum over forward passes of the rows in the pass (rows / passes = mean batch size).
    forward_rows: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    busy_seconds: float = 0.0

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


class Batcher:
    """Owns the engine; `submit` from any thread, results come back through Sequence callbacks."""

    def __init__(self, engine: Engine, max_batch_size: int = 32, max_batch_tokens: int = 16384,
                 wait_ms: float = 5.0) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.wait_s = wait_ms / 1000.0
        self.stats = Stats()
        self._queue: queue.Queue[Sequence | None] = queue.Queue()
        self._carry: Sequence | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="dspark-batcher", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._queue.qsize() + (self._carry is not None)

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue the choices of one request (they may land in the same batch or not)."""
        with self._lock:
            self.stats.requests += 1
            self.stats.sequences += len(sequences)
            self.stats.prompt_tokens += len(sequences[0].prompt_ids) if sequences else 0
        for seq in sequences:
            self._queue.put(seq)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _gather(self, batch: list[Sequence], room: int, deadline: float | None) -> list[Sequence]:
        """Append queued sequences to `batch` while it holds fewer than `room` and its padded prompts
        fit `max_batch_tokens`; wait for arrivals until `deadline` (monotonic), or not at all (None).

        The first sequence that does not fit is carried to the next call, cancelled ones are
        finished here, and the close() sentinel is put back for the main loop to see.
        """
        longest = max((len(s.prompt_ids) for s in batch), default=0)
        while len(batch) < room:
            seq, self._carry = self._carry, None
            if seq is None:
                try:
                    seq = (self._queue.get_nowait() if deadline is None
                           else self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            if seq is None:
                self._queue.put(None)
                break
            if seq.cancelled.is_set():  # the client went away while queued
                self._finish_cancelled(seq)
                continue
            if (len(batch) + 1) * max(longest, len(seq.prompt_ids)) > self.max_batch_tokens:
                self._carry = seq  # first in line next time
                break
            batch.append(seq)
            longest = max(longest, len(seq.prompt_ids))
        return batch

    @staticmethod
    def _finish_cancelled(seq: Sequence) -> None:
        seq.finish_reason = "cancelled"
        seq.on_event("", "cancelled")

    def _next_batch(self) -> list[Sequence] | None:
        """Wait for a first sequence, give late arrivals `wait_s` to join; None once closed."""
        first = self._carry or self._queue.get()
        self._carry = None
        if first is None:
            return None
        if first.cancelled.is_set():
            self._finish_cancelled(first)
            return []
        return self._gather([first], self.max_batch_size, time.monotonic() + self.wait_s)

    def _take_new(self, running: int, started: list[Sequence]) -> list[Sequence]:
        """Queued sequences that fit in the running batch now (called between decoding steps)."""
        joining = self._gather([], self.max_batch_size - running, deadline=None)
        if joining:
            started.extend(joining)
            with self._lock:
                self.stats.joined += len(joining)
                self.stats.max_batch_size = max(self.stats.max_batch_size, running + len(joining))
        return joining

    def _count_forward(self, rows: int) -> None:
        with self._lock:
            self.stats.forward_passes += 1
            self.stats.forward_rows += rows

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if not batch:
                continue
            started = time.monotonic()
            with self._lock:
                self.stats.batches += 1
                self.stats.max_batch_size = max(self.stats.max_batch_size, len(batch))
            started_seqs = list(batch)
            try:
                self.engine.generate(batch, on_forward=self._count_forward,
                                     take_new=functools.partial(self._take_new, started=started_seqs))
            except Exception as e:  # report to the clients, keep serving
                console.print(f"[red]generation failed for a batch of {len(batch)}:[/] {e!r}")
                for seq in started_seqs:
                    if not seq.done:
                        seq.finish_reason = "error"
                        seq.on_event("", "error")
            with self._lock:
                self.stats.busy_seconds += time.monotonic() - started
                self.stats.completion_tokens += sum(s.generated for s in started_seqs)
