"""One training sample: what `cache build` stores per sequence and what `train` reads (contract 3).

    s = Sample("r0001", input_ids, loss_mask, hidden_states, final_hidden)
    s.final_at(positions)   # the target's final state at any positions, zeros off the loss mask

`final_hidden` is compact, one row per loss-mask position in order (`final_positions`): the
target's distribution is only ever needed where the drafter is supervised, so neither the cache,
the reader nor the packer holds the zero rows in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    hidden_states: torch.Tensor | None = None  # bf16 [T, m*d], None until the target has run
    final_hidden: torch.Tensor | None = None  # bf16 [K, d] at final_positions (K = loss_mask.sum())
    split: str = "train"

    @property
    def nbytes(self) -> int:
        """Memory the sample's tensors hold."""
        return sum(t.numel() * t.element_size() for t in (self.input_ids, self.loss_mask, self.hidden_states,
                                                           self.final_hidden) if t is not None)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def final_positions(self) -> torch.Tensor:
        """The positions of final_hidden's rows → LongTensor [K]."""
        return self.loss_mask.nonzero().squeeze(-1)

    def final_at(self, positions: torch.Tensor) -> torch.Tensor:
        """final_hidden at `positions` (any shape, values < T) → [*positions.shape, d]; zeros where
        the loss mask is 0, exactly what a dense [T, d] layout would give."""
        assert self.final_hidden is not None, "final_at before the target's forward"
        row = self.loss_mask.long().cumsum(0) - 1  # [T]: final_hidden row of each supervised position
        out = self.final_hidden.new_zeros(*positions.shape, self.final_hidden.shape[-1])
        on = self.loss_mask[positions]
        out[on] = self.final_hidden[row[positions[on]]]
        return out
