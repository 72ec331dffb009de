"""Which N target tokens a reduced draft vocabulary keeps (`model.draft_vocab_size`, docs/train.md).

The drafter can only propose tokens of its draft vocabulary, so it keeps the ones the target
writes most: the N most frequent tokens of the training responses (loss-masked tokens, the ones
draft slots are trained to predict), ties to the lower id. Counting stops after `MAX_TOKENS`
response tokens, in the split's order: the ranking of frequent tokens settles long before that, and
a 1.42M-conversation cache is not read whole before the first step. The choice is stored in the
drafter (`draft_token_ids`) and so in every checkpoint: a resume takes the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..errors import DsparkError
from ..sample import Sample

#: Response tokens counted at most (about a minute of reading the index arrays of a large cache).
MAX_TOKENS = 50_000_000


def count_sample_tokens(samples: Sequence[Sample], vocab: int, max_tokens: int = MAX_TOKENS) -> np.ndarray:
    """Response-token counts [vocab] over samples in order (any sequence of `Sample`s)."""
    counts = np.zeros(vocab, dtype=np.int64)
    seen = 0
    for i in range(len(samples)):
        s = samples[i]
        ids = s.input_ids[s.loss_mask.bool()].numpy()
        counts += np.bincount(ids, minlength=vocab)[:vocab]
        seen += ids.size
        if seen >= max_tokens:
            break
    return counts


def response_token_counts(dataset: Sequence[Sample], vocab: int, max_tokens: int = MAX_TOKENS) -> np.ndarray:
    """Counts from the cache's index arrays when the dataset is a cache split (no hidden states
    read), else sample by sample."""
    fast = getattr(dataset, "response_token_counts", None)
    return fast(vocab, max_tokens) if fast is not None else count_sample_tokens(dataset, vocab, max_tokens)


def choose_draft_vocab(counts: np.ndarray, size: int) -> torch.Tensor:
    """The `size` most frequent ids (ties: lower id first), ascending → int64 [size]."""
    if int((counts > 0).sum()) == 0:
        raise DsparkError("model.draft_vocab_size: the training split has no response tokens to count.")
    order = np.lexsort((np.arange(counts.size), -counts))  # by count descending, then id
    return torch.from_numpy(np.sort(order[:size]).astype(np.int64))


def coverage(counts: np.ndarray, ids: torch.Tensor) -> float:
    """Share of the counted response tokens the draft vocabulary holds."""
    total = int(counts.sum())
    return float(counts[ids.numpy()].sum()) / total if total else 0.0
