"""The training loop's bounded prefetch: order, bound, errors, and a thread that ends on every exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from dspark_cli.train.prefetch import Prefetcher


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "train-prefetch"]


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_results_come_in_order_and_at_most_depth_ahead(depth):
    made: list[int] = []

    def make(i: int) -> torch.Tensor:
        made.append(i)
        return torch.full((2,), float(i)) * 2

    with Prefetcher(make, range(8), depth=depth) as batches:
        for taken, result in enumerate(batches, 1):
            assert result.tolist() == [2.0 * (taken - 1)] * 2
            time.sleep(0.02)  # give the producer time to run ahead as far as it may
            # taken results + `depth` waiting in the queue + the one being made (blocked on put)
            assert len(made) <= taken + depth + (1 if depth else 0)
    assert made == list(range(8)) and not prefetch_threads()


def test_a_producer_error_is_raised_at_its_item_and_the_thread_ends():
    def make(i: int) -> int:
        if i == 3:
            raise ValueError("bad sample 3")
        return i

    batches = Prefetcher(make, range(10), depth=2)
    assert [next(batches) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="bad sample 3"):
        next(batches)
    assert not prefetch_threads()
    with pytest.raises(StopIteration):  # closed: nothing more, and no hang
        next(batches)


def test_closing_early_stops_a_producer_that_is_ahead():
    made: list[int] = []
    batches = Prefetcher(lambda i: made.append(i) or i, range(10_000), depth=2)
    assert next(batches) == 0
    batches.close()
    assert not prefetch_threads() and len(made) < 10
    batches.close()  # idempotent


def test_an_error_in_the_training_loop_exits_cleanly_with_the_producer_running_torch():
    """The consumer fails while the producer is mid-forward: one traceback, no 'terminate called'."""
    script = textwrap.dedent("""
        import torch
        from dspark_cli.train.prefetch import Prefetcher

        weight = torch.randn(256, 256)

        def make(i):
            x = torch.randn(64, 256)
            for _ in range(50):
                x = torch.tanh(x @ weight)
            return x

        batches = Prefetcher(make, range(1000), depth=2)
        try:
            for step, x in enumerate(batches):
                if step == 2:
                    raise RuntimeError("drafter step failed")
        finally:
            batches.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "RuntimeError: drafter step failed" in done.stderr
    assert "terminate called" not in done.stderr and "Fatal Python error" not in done.stderr
