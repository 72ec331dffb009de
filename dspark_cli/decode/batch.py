"""The target side of a batched round: R sequences in one KV cache, verified in one forward.

Row r of the cache holds every position before request r's anchor. Rows have different lengths,
so the cache is ragged in two ways, both handled by the 2-D attention mask [R, T] (1 = a real
cached position) and explicit per-row position ids:

- a request that joins is prefilled on its own and left-padded under the others;
- a round feeds row r its anchor and ℓ_r drafted tokens, right-padded to the longest row; after
  verification row r keeps its anchor and accepted tokens (keep_r), the cache is cropped to the
  longest keep and shorter rows' leftovers stay as masked holes.

A position is never moved once cached, so no round copies the cache; joins and leaves do, once
per request.

    batch = TargetBatch(model, layers)
    hidden, final = batch.add(prompt_ids)                # prefill one request (its own row)
    hidden, final = batch.forward(inputs, positions)     # one verification pass, all rows
    batch.commit(keep)                                   # keep_r new positions per row
"""

from __future__ import annotations

from typing import Any

import torch

from ..target.capture import capture_batch, capture_step, stack_left_padded
from .sps import crop_cache


class TargetBatch:
    """R sequences' KV cache and attention mask on the target (see module doc)."""

    def __init__(self, model: Any, layers: list[int]) -> None:
        self.model, self.layers = model, layers
        self.device = next(model.parameters()).device
        self.cache: Any = None
        self.attention = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # [R, T]

    @property
    def rows(self) -> int:
        return int(self.attention.shape[0])

    def add(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill a new last row; returns its features [n, m·d] and final states [n, d]."""
        cap = capture_step(self.model, prompt_ids, self.layers)
        ones = torch.ones((1, len(prompt_ids)), dtype=torch.long, device=self.device)
        if self.cache is None or self.rows == 0:
            self.cache, self.attention = cap.past_key_values, ones
        else:
            self.attention = stack_left_padded(self.cache, self.attention, cap.past_key_values, ones)
        return cap.hidden, cap.final

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, in this order; drop columns no remaining row uses at the left."""
        if not rows:
            self.cache, self.attention = None, self.attention[:0, :0]
            return
        if rows == list(range(self.rows)):
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.attention = self.attention.index_select(0, index)
        lead = int(self.attention.any(dim=0).long().argmax())
        if lead:
            self.attention = self.attention[:, lead:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]

    def forward(self, inputs: list[list[int]], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed row r `inputs[r]` at positions positions[r]…, right-padded to the longest row.

        Returns features [R, q, m·d] and final normed states [R, q, d] (padded slots are junk).
        The cache then holds q more columns per row until `commit`.
        """
        q = max(len(x) for x in inputs)
        ids = torch.tensor([x + x[-1:] * (q - len(x)) for x in inputs], dtype=torch.long)  # [R, q]
        real = torch.tensor([[1] * len(x) + [0] * (q - len(x)) for x in inputs], dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)[:, None] + torch.arange(q)[None]  # [R, q]
        attention = torch.cat([self.attention, real.to(self.device)], dim=1)
        cap = capture_batch(self.model, ids, self.layers, attention_mask=attention,
                            position_ids=pos.to(self.device), past_key_values=self.cache, use_cache=True)
        self.cache = cap.past_key_values
        return cap.hidden, cap.final

    def commit(self, keep: list[int]) -> None:
        """After `forward`: row r keeps its first keep[r] new positions; the rest is dropped/masked."""
        width = max(keep)
        old = self.attention.shape[1]
        crop_cache(self.cache, old + width)
        kept = torch.arange(width)[None] < torch.tensor(keep)[:, None]  # [R, width]
        self.attention = torch.cat([self.attention, kept.long().to(self.device)], dim=1)
