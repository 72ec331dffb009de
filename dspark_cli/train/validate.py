"""Held-out metrics at the end of training: the same loss terms and acceptance on the cache's
validation split, without gradients, so a run reports how well it generalises, not just fits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..model.attention import step_mask
from ..model.config import DrafterConfig
from ..sample import Sample
from .data import load_batch
from .loss import DrafterLoss, summarize


@torch.no_grad()
def evaluate(loss_module: DrafterLoss, dataset: Sequence[Sample], config: DrafterConfig, *,
             num_anchors: int, seed: int, micro_batch: int, limit: int, device: torch.device,
             flex: bool, confidence_out: list | None = None) -> dict[str, Any] | None:
    """Mean loss terms and acceptance over up to `limit` samples (anchors seeded as in training);
    `confidence_out` collects the confidence head's held-out slots (`DrafterLoss.forward`)."""
    n = min(limit, len(dataset))
    if n == 0:
        return None
    was_training = loss_module.training
    loss_module.eval()
    totals: dict[str, torch.Tensor] = {}
    batches = 0
    for start in range(0, n, micro_batch):
        indices = list(range(start, min(n, start + micro_batch)))
        batch = load_batch(dataset, indices, 0, num_anchors, seed, config).to(device)
        mask = step_mask(batch.layout, flex, split=loss_module.fast_kernels)
        _, stats = loss_module(batch, mask, confidence_out)
        for k, v in stats.items():
            totals[k] = totals.get(k, 0) + v.float().cpu()
        batches += 1
    for k in ("loss", "ce", "tv", "conf_bce"):
        totals[k] = totals[k] / batches
    loss_module.train(was_training)
    return {"samples": n, **summarize(totals, loss_module.drafter.confidence_head is not None)}
