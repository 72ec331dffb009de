"""A micro-batch of the plan's shapes, packed by the trainer's own code (`train.blocks.pack`), so
the traced activations and the FLOPs see the blocks and contexts a real step sees."""

from __future__ import annotations

import torch

from ..model.config import DrafterConfig
from ..sample import Sample
from ..train.anchors import sample_anchors
from ..train.blocks import PackedBatch, pack


def synthetic_sample(c: DrafterConfig, tokens: int, loss_tokens: int, i: int = 0) -> Sample:
    """A sample of `tokens` positions whose last `loss_tokens` are supervised (zeros for states:
    only shapes matter here)."""
    loss_tokens = max(2, min(loss_tokens, tokens - 1))
    mask = torch.zeros(tokens, dtype=torch.bool)
    mask[tokens - loss_tokens:] = True
    ids = torch.zeros(tokens, dtype=torch.long)
    hidden = torch.zeros(tokens, c.num_context_layers * c.hidden_size, dtype=torch.bfloat16)
    final = torch.zeros(loss_tokens, c.hidden_size, dtype=torch.bfloat16)
    return Sample(f"plan-{i}", ids, mask, hidden, final)


def synthetic_micro_batch(c: DrafterConfig, samples: list[tuple[int, int]], num_anchors: int) -> PackedBatch:
    """Pack samples [(tokens, loss tokens)] with anchors drawn as the trainer draws them."""
    made = [synthetic_sample(c, t, n, i) for i, (t, n) in enumerate(samples)]
    anchors = [sample_anchors(s.loss_mask, num_anchors, torch.Generator().manual_seed(i))
               for i, s in enumerate(made)]
    return pack(made, anchors, c)
