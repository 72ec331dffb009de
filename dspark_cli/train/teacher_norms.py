"""The target distribution's log-normaliser of each cached state, kept from one step to the next.

With a reduced draft vocabulary (model.draft_vocab_size) the loss needs p_t only on the draft's N
columns and the mass outside them, and both follow from those N logits and log Σ_V exp(logits).
Only that normaliser needs the whole [S, V] product with the target's head. A cached state and
the frozen head never change, so a state's normaliser is computed the first time the state is
seen (the first epoch) and looked up afterwards: the later epochs multiply N columns, not V (the
demo: 8192 of 49152).

States are keyed by their bits (a hash, and the sum of their 16-bit words as a check against a
collision; both exact, whatever the batch they come in), so the
same table serves every split and sample order, and a state that differs in one bit is new. The
table stops growing at `max_entries` (~150 B an entry): a larger run computes the rest as before.
"""

from __future__ import annotations

import torch

#: About 150 MB of Python dict at most; the demo holds ~100k states.
MAX_ENTRIES = 1 << 20


class TeacherNorms:
    """log Σ_V exp(lm_head · state) by state, for one frozen head (`for_head` clears on a new one)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._table: dict[int, tuple[int, float]] = {}  # hash → (check, log-normaliser)
        self._head: object | None = None

    def __len__(self) -> int:
        return len(self._table)

    def for_head(self, head: object) -> TeacherNorms:
        """Self, emptied if `head` is not the head the stored normalisers were computed with."""
        if head is not self._head:
            self._table.clear()
            self._head = head
        return self

    @staticmethod
    def keys(states: torch.Tensor) -> tuple[list[int], list[int]]:
        """(hash, check) per row of states [S, d]: the hash of the row's bytes and the integer sum
        of its 16-bit words."""
        words = states.detach().contiguous().view(torch.int16).cpu()  # bf16 or fp32 bits
        checks = words.to(torch.int64).sum(-1).tolist()
        return [hash(row.tobytes()) for row in words.numpy()], checks

    def lookup(self, keys: list[int], checks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-normaliser [S] float32, known [S] bool); unknown rows read 0."""
        found = [self._table.get(k) for k in keys]
        known = [f is not None and f[0] == c for f, c in zip(found, checks, strict=True)]
        values = [f[1] if ok else 0.0 for f, ok in zip(found, known, strict=True)]
        return torch.tensor(values, dtype=torch.float32), torch.tensor(known, dtype=torch.bool)

    def store(self, keys: list[int], checks: list[int], lse: torch.Tensor) -> None:
        """Remember the normalisers of these rows while there is room."""
        for key, check, value in zip(keys, checks, lse.tolist(), strict=True):
            if len(self._table) >= self.max_entries:
                return
            self._table[key] = (check, value)
