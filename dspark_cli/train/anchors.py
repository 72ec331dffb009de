"""Anchor sampling (DESIGN.md §3): where blocks start, drawn on the fly, seeded, reproducible.

Position i may anchor a block when loss_mask[i] and loss_mask[i+1] are both set: the anchor token
is a response token and slot 0 has a supervised label. Up to `num_anchors` are drawn without
replacement from a generator seeded by (seed, epoch, sample index), so the same sample gets the
same anchors in a run, a resumed run and a run on any number of ranks.
"""

from __future__ import annotations

import torch


def candidate_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions i with loss_mask[i] & loss_mask[i+1] → LongTensor [n] (ascending)."""
    lm = loss_mask.bool()
    return torch.nonzero(lm[:-1] & lm[1:], as_tuple=False).flatten()


def anchor_generator(seed: int, epoch: int, sample_index: int) -> torch.Generator:
    """A generator that depends only on (seed, epoch, sample index)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_000_007 + sample_index)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Up to num_anchors candidate positions without replacement, sorted → LongTensor [A]."""
    candidates = candidate_anchors(loss_mask)
    if candidates.numel() <= num_anchors:
        return candidates
    pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
    return candidates[pick].sort().values
