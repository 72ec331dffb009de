"""Which N target tokens a reduced draft vocabulary keeps (`model.draft_vocab_size`, docs/train.md).

The drafter can only propose tokens of its draft vocabulary, so it keeps the ones the target
writes most: the N most frequent tokens of the training responses (loss-masked tokens, the ones
draft slots are trained to predict). A small cache's responses use fewer than N distinct tokens;
the rest of the N are then the tokens its prompts use most (a response quotes and continues its
prompt: GSM8K's numbers, HumanEval's identifiers), and only then the lowest ids. Counting stops
after `MAX_TOKENS` response tokens, in the split's order: the ranking of frequent tokens settles
long before that, and a 1.42M-conversation cache is not read whole before the first step. The
choice is stored in the drafter (`draft_token_ids`) and so in every checkpoint: a resume takes
the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..errors import DsparkError
from ..sample import Sample

#: Response tokens counted at most (about a minute of reading the index arrays of a large cache).
MAX_TOKENS = 50_000_000


class TokenCounts(NamedTuple):
    """Per-id counts [vocab] of a split: response (loss-masked) tokens, and all its other tokens."""

    response: np.ndarray
    context: np.ndarray


def count_sample_tokens(samples: Sequence[Sample], vocab: int, max_tokens: int = MAX_TOKENS) -> TokenCounts:
    """Token counts over samples in order (any sequence of `Sample`s)."""
    response = np.zeros(vocab, dtype=np.int64)
    context = np.zeros(vocab, dtype=np.int64)
    seen = 0
    for i in range(len(samples)):
        s = samples[i]
        in_response = s.loss_mask.bool()
        ids = s.input_ids[in_response].numpy()
        response += np.bincount(ids, minlength=vocab)[:vocab]
        context += np.bincount(s.input_ids[~in_response].numpy(), minlength=vocab)[:vocab]
        seen += ids.size
        if seen >= max_tokens:
            break
    return TokenCounts(response, context)


def split_token_counts(dataset: Sequence[Sample], vocab: int, max_tokens: int = MAX_TOKENS) -> TokenCounts:
    """Counts from the cache's index arrays when the dataset is a cache split (no hidden states
    read), else sample by sample."""
    fast = getattr(dataset, "split_token_counts", None)
    return TokenCounts(*fast(vocab, max_tokens)) if fast is not None else count_sample_tokens(dataset, vocab,
                                                                                              max_tokens)


def choose_draft_vocab(counts: TokenCounts, size: int) -> torch.Tensor:
    """The `size` most frequent response ids, then the prompts' most frequent, then the lowest ids;
    ascending → int64 [size]."""
    if int((counts.response > 0).sum()) == 0:
        raise DsparkError("model.draft_vocab_size: the training split has no response tokens to count.")
    ids = np.arange(counts.response.size)
    order = np.lexsort((ids, -counts.context, -counts.response))  # last key first: response, context, id
    return torch.from_numpy(np.sort(order[:size]).astype(np.int64))


def coverage(counts: TokenCounts, ids: torch.Tensor) -> float:
    """Share of the counted response tokens the draft vocabulary holds."""
    total = int(counts.response.sum())
    return float(counts.response[ids.numpy()].sum()) / total if total else 0.0


def describe(counts: TokenCounts, ids: torch.Tensor) -> str:
    """One line for the train log: what the draft vocabulary was chosen from and what it holds."""
    distinct = int((counts.response > 0).sum())
    line = (f"the {ids.numel()} most frequent of {distinct:,} distinct ids in {int(counts.response.sum()):,} "
            f"training response tokens ({coverage(counts, ids):.2%} of them)")
    if distinct < ids.numel():
        chosen = ids.numpy()
        from_prompts = int(((counts.response[chosen] == 0) & (counts.context[chosen] > 0)).sum())
        unseen = ids.numel() - distinct - from_prompts
        line += f"; the other {ids.numel() - distinct:,} from the prompts' tokens"
        line += f" ({from_prompts:,}) and the lowest unseen ids ({unseen:,})" if unseen else ""
    return line
