"""A bounded background producer: the next micro-batches are made while the drafter trains on this one.

    with Prefetcher(make_batch, items, depth=2) as batches:
        for batch in batches: ...

Online, making a micro-batch is the target's forward, which then overlaps the drafter's step (on
CUDA the target runs on its own stream; on CPU the two share the cores, so the gain is small);
from a cache it is the read and the packing. At most `depth` finished results wait in the queue,
so memory stays bounded. The thread ends on every exit path: `close()` (also `with`'s exit, also
after the producer failed) stops it and joins it, so no thread is left running torch when the
interpreter exits. The producer's exception is raised in the caller, at the item where it
happened. depth 0 makes each item in the caller's thread (no thread at all).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch

Item = TypeVar("Item")
Result = TypeVar("Result")

_END = object()
_POLL_S = 0.05


class Prefetcher(Generic[Item, Result]):
    def __init__(self, make: Callable[[Item], Result], items: Iterable[Item], depth: int = 2) -> None:
        self._make, self._items = make, iter(items)
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._thread: threading.Thread | None = None
        self._finished = False
        self._threads = torch.get_num_threads()
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name="train-prefetch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        torch.set_num_threads(self._threads)  # a new thread would start at the library default
        try:
            for item in self._items:
                if self._stop.is_set() or not self._put((self._make(item), None)):
                    return
        except BaseException as e:  # handed to the caller at this item
            self._put((None, e))
            return
        self._put(_END)

    def _put(self, entry: Any) -> bool:
        """Queue `entry`, waiting for room; False once the consumer has closed us."""
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Result]:
        return self

    def __next__(self) -> Result:
        if self._finished:
            raise StopIteration
        if self._thread is None:
            try:
                return self._make(next(self._items))
            except StopIteration:
                self._finished = True
                raise
        while True:
            try:
                entry = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._finished = True
                    raise RuntimeError("the prefetch thread ended without a result") from None
        if entry is _END:
            self._finished = True
            raise StopIteration
        result, error = entry
        if error is not None:
            self.close()
            raise error
        return result

    def close(self) -> None:
        """Stop the producer (after the item it is making) and wait for it; idempotent."""
        self._finished = True
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        while not self._queue.empty():  # drop made results now, not at garbage collection
            self._queue.get_nowait()

    def __enter__(self) -> Prefetcher[Item, Result]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
