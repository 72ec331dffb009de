"""Where a fresh Markov head's W1 rows start (`train.markov_init`, docs/train.md).

"random" is the earlier behaviour: every row N(0, 0.02²), so a token that never precedes a draft
slot in training keeps a row of noise, and the W2 learned on other tokens maps that noise to a bias
on new prompts. "embedding" starts each row at the target's own embedding of the token projected
on its top-r principal directions (scaled to the same 0.02 spread), so tokens the target embeds
alike start alike and what W2 learns for one carries to its neighbours. Only the starting point
changes: W1 stays a free table, and the export is the same tensors in the same form. Measured on
SmolLM2 at the bench-quality budget it made no live difference, so "random" is the default.
"""

from __future__ import annotations

import torch

from .heads import MarkovHead

#: The spread MarkovHead's own N(0, σ²) rows start at: the embedding start matches it, so AdamW's
#: steps (about lr per entry) move both by the same fraction.
ROW_STD = 0.02


@torch.no_grad()
def embedding_rows(embed: torch.Tensor, rank: int) -> torch.Tensor:
    """[V, d] embedding → [V, rank] rows: the centred embedding on its top principal directions.

    The directions come from the d×d covariance (an eigendecomposition, cheap even for a 150k × 5k
    table). When rank > d the extra columns are N(0, ROW_STD²) noise, never zeros: a zero column of
    W1 gives its W2 column no gradient, and W2 starts at zero, so both would stay dead.
    """
    table = embed.float()
    centred = table - table.mean(0)
    _, vectors = torch.linalg.eigh(centred.T @ centred)  # ascending eigenvalues
    top = vectors.flip(-1)[:, :rank]
    rows = centred @ top
    rows *= ROW_STD / rows.std().clamp_min(1e-12)
    if rank > rows.shape[1]:
        noise = torch.randn(rows.shape[0], rank - rows.shape[1]) * ROW_STD  # the trainer's seeded RNG
        rows = torch.cat([rows, noise], dim=1)
    return rows


@torch.no_grad()
def init_markov_rows(head: MarkovHead | None, embed: torch.Tensor, setting: str) -> None:
    """Apply `train.markov_init` to a fresh drafter's Markov head (no head, or "random": untouched)."""
    if head is None or setting == "random":
        return
    weight = head.markov_w1.weight
    weight.copy_(embedding_rows(embed, head.rank).to(weight.dtype))
