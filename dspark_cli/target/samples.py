"""Responses → training samples: what `cache build` stores and `train --online` feeds, one home.

    samples, skipped, skipped_ids = render_rows(tokenizer, rows, max_length=4096, min_loss_tokens=16)
    forward_samples(model, samples, layers, batch_tokens=16384)   # fills hidden_states / final_hidden

Rendering (chat template, loss mask, truncation) and the skip rules decide which rows become
samples and what their tokens are; the forward fills their features and rounds them to bf16, the
cache's storage dtype. A drafter trained online therefore sees the same samples, the same
anchors and the same features as one trained from a cache of the same responses.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..errors import DsparkError
from ..sample import Sample
from .capture import capture_batch
from .render import render_conversation

#: Response columns the rendering reads (contract 2).
INPUT_COLUMNS = ["id", "split", "messages", "reasoning", "thinking"]
#: Skipped-row ids kept as examples (the counts are complete).
SKIPPED_IDS_KEPT = 20


def read_response_rows(url: str) -> Iterator[dict[str, Any]]:
    """The responses artifact's rows, in input order, with the columns rendering needs."""
    from ..data.io import read_rows

    return read_rows(url, columns=INPUT_COLUMNS)


def skip_reason(tokenizer: Any, row: dict[str, Any], max_length: int, min_loss_tokens: int
                ) -> tuple[Sample | None, str | None]:
    """(the row's sample, None), or (None, why it is skipped): the skip rules, in one place."""
    messages = row.get("messages") or []
    if not any(m.get("role") == "assistant" for m in messages):
        return None, "no_assistant_turn"
    try:
        ids, mask = render_conversation(tokenizer, messages, bool(row.get("thinking")), max_length,
                                        reasoning=row.get("reasoning"))
    except DsparkError:
        return None, "template_mismatch"
    if sum(mask) < min_loss_tokens:
        return None, "too_few_loss_tokens"
    return Sample(str(row["id"]), torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool),
                  split=str(row.get("split") or "train")), None


def render_rows(tokenizer: Any, rows: list[dict[str, Any]], max_length: int, min_loss_tokens: int
                ) -> tuple[list[Sample], dict[str, int], list[str]]:
    """Render rows in order; too-short or unrenderable ones are skipped and counted by reason."""
    samples: list[Sample] = []
    skipped: dict[str, int] = {}
    skipped_ids: list[str] = []
    for row in rows:
        sample, reason = skip_reason(tokenizer, row, max_length, min_loss_tokens)
        if sample is not None:
            samples.append(sample)
            continue
        skipped[reason] = skipped.get(reason, 0) + 1
        if len(skipped_ids) < SKIPPED_IDS_KEPT:
            skipped_ids.append(str(row.get("id")))
    return samples, skipped, skipped_ids


def forward_samples(model: Any, samples: list[Sample], layers: list[int], batch_tokens: int) -> int:
    """Fill each sample's features (bf16); equal-length samples share a forward (no padding: bit-exact).

    Returns the number of tokens forwarded.
    """
    by_length: dict[int, list[Sample]] = {}
    for s in samples:
        by_length.setdefault(len(s.input_ids), []).append(s)
    tokens = 0
    for length in sorted(by_length):
        group = by_length[length]
        per_batch = max(1, batch_tokens // length)
        for i in range(0, len(group), per_batch):
            batch = group[i:i + per_batch]
            ids = torch.stack([s.input_ids for s in batch])  # [B, T]
            cap = capture_batch(model, ids, layers)
            hidden = cap.hidden.to(torch.bfloat16).cpu()  # [B, T, m*d]
            final = cap.final.to(torch.bfloat16).cpu()  # [B, T, d]
            for b, s in enumerate(batch):
                s.hidden_states = hidden[b].clone()
                s.final_hidden = final[b][s.loss_mask].clone()  # [K, d]
            tokens += ids.numel()
    return tokens
