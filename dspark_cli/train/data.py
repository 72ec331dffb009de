"""Which samples each rank reads at each step, and turning them into packed blocks.

The order is a seeded permutation per epoch; step s of an epoch takes samples
order[s·G : (s+1)·G] (G = global batch); rank r takes its contiguous share of those and splits it
into micro-batches. The micro-batches of a step are therefore the same whatever the number of
ranks, which is what makes a 2-process run match a 1-process run, and a resumed run match an
uninterrupted one (the data position is just the step number).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..errors import DsparkError
from ..model.config import DrafterConfig
from ..sample import Sample
from .anchors import anchor_generator, sample_anchors
from .blocks import PackedBatch, pack


@dataclass
class StepPlan:
    num_samples: int
    global_batch: int
    micro_batch: int
    world_size: int = 1
    rank: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        per_rank, rem = divmod(self.global_batch, self.world_size)
        if rem or per_rank % self.micro_batch:
            raise DsparkError(f"train.global_batch {self.global_batch} must split evenly into "
                              f"{self.world_size} rank(s) × micro-batches of {self.micro_batch}.")
        if self.num_samples < self.global_batch:
            raise DsparkError(f"the cache has {self.num_samples} training samples, fewer than "
                              f"train.global_batch = {self.global_batch}.",
                              hint="lower train.global_batch or cache more samples.")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return self.global_batch // self.world_size // self.micro_batch

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of sample indices (computed once per epoch; a tensor, 8 bytes a
        sample, not a list: at Open-PerfectBlend's 1.4M samples a list costs ~50 MB more)."""
        cached = getattr(self, "_order", None)
        if cached is None or cached[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._order = (epoch, torch.randperm(self.num_samples, generator=gen))
        return self._order[1]

    def rank_indices(self, step: int) -> torch.Tensor:
        """Every sample index this rank reads from `step` to the end of its epoch, in order."""
        epoch, s = divmod(step, self.steps_per_epoch)
        share = self.global_batch // self.world_size
        steps = self.order(epoch)[:self.steps_per_epoch * self.global_batch].view(self.steps_per_epoch, -1)
        return steps[s:, self.rank * share:(self.rank + 1) * share].reshape(-1)

    def micro_batches(self, step: int) -> tuple[int, list[list[int]]]:
        """(epoch, this rank's micro-batches of sample indices) for a global step."""
        epoch, s = divmod(step, self.steps_per_epoch)
        chosen = self.order(epoch)[s * self.global_batch:(s + 1) * self.global_batch].tolist()
        share = self.global_batch // self.world_size
        mine = chosen[self.rank * share:(self.rank + 1) * share]
        return epoch, [mine[i:i + self.micro_batch] for i in range(0, share, self.micro_batch)]


def load_batch(dataset: Sequence[Sample], indices: list[int], epoch: int, num_anchors: int, seed: int,
               config: DrafterConfig) -> PackedBatch:
    """Read samples, draw their anchors (seeded per sample and epoch), pack.

    A micro-batch without any anchor still yields one unsupervised block (zero loss, zero
    gradient), so every DDP rank runs the same number of backward passes.
    """
    get_many = getattr(dataset, "get_many", None)  # online: one target pass for the micro-batch
    samples = get_many(indices) if get_many is not None else [dataset[i] for i in indices]
    anchors = [sample_anchors(s.loss_mask, num_anchors, anchor_generator(seed, epoch, i))
               for s, i in zip(samples, indices, strict=True)]
    if all(a.numel() == 0 for a in anchors):
        anchors[0] = torch.zeros(1, dtype=torch.long)
        batch = pack(samples, anchors, config)
        batch.valid.zero_()
        return batch
    return pack(samples, anchors, config)


@dataclass
class MicroBatch:
    """A packed micro-batch (on the host) and what making it cost."""

    step: int
    epoch: int
    batch: PackedBatch
    #: Seconds of the target's forward spent on it (online training; 0 from a cache).
    target_s: float
    #: Seconds to make it in all (read or forward, render, pack).
    made_s: float


def plan_items(plan: StepPlan, start: int, stop: int) -> Iterator[tuple[int, int, list[int]]]:
    """(step, epoch, sample indices) of this rank's micro-batches for steps start..stop-1, in order."""
    for step in range(start, stop):
        epoch, micro = plan.micro_batches(step)
        for indices in micro:
            yield step, epoch, indices


class BatchMaker:
    """Makes the MicroBatch of a `plan_items` item (in the prefetch thread)."""

    def __init__(self, dataset: Sequence[Sample], plan: StepPlan, num_anchors: int, seed: int,
                 config: DrafterConfig) -> None:
        self.dataset, self.plan, self.config = dataset, plan, config
        self.num_anchors, self.seed = num_anchors, seed
        self._epoch = -1

    def __call__(self, item: tuple[int, int, list[int]]) -> MicroBatch:
        step, epoch, indices = item
        if epoch != self._epoch and hasattr(self.dataset, "set_order"):
            # Tell the cache reader's prefetcher which samples this rank reads next, in order.
            self.dataset.set_order(self.plan.rank_indices(step))
        self._epoch = epoch
        target_before = getattr(self.dataset, "forward_seconds", 0.0)
        started = time.perf_counter()
        batch = load_batch(self.dataset, indices, epoch, self.num_anchors, self.seed, self.config)
        return MicroBatch(step, epoch, batch, getattr(self.dataset, "forward_seconds", 0.0) - target_before,
                          time.perf_counter() - started)
