"""Per-request sampling over a batch of logits: temperature, top-k, top-p, min-p, seeded draws.

Rows of one forward batch belong to different requests, so every knob is a per-row tensor and
every row draws from its own `torch.Generator` (a request's `seed` reproduces its output no matter
which other requests shared the batch). The filter order is the Transformers one:
temperature → top-k → top-p → min-p.

Speed matters on CPU (one call per decoding step for the whole batch): rows that filter nothing
(top-k off, top-p 1, min-p 0: the OpenAI defaults) draw straight from the softmax; the others are
filtered on the `k` best logits only (`topk` instead of a full vocabulary sort when every filtered
row sets top-k: a full sort of 32 × 49k logits costs ~200 ms, more than the forward pass). Every
row draws by inverse CDF (one uniform from its generator + a binary search) instead of
`torch.multinomial` over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.draw import draw


@dataclass(frozen=True)
class SamplingParams:
    """What one choice of one request asks for (already validated by the app)."""

    temperature: float = 1.0
    top_p: float = 1.0
    #: 0 or -1 disables top-k.
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def kept_top_k(self, vocab_size: int) -> int:
        """How many best tokens top-k keeps: all of them when it is off (0, -1 or ≥ vocab_size)."""
        return self.top_k if 0 < self.top_k < vocab_size else vocab_size

    def filters(self, vocab_size: int) -> bool:
        """Whether top-k, top-p or min-p removes anything from a `vocab_size` distribution."""
        return self.kept_top_k(vocab_size) < vocab_size or self.top_p < 1.0 or self.min_p > 0.0


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> torch.Tensor:
    """Next token per row. logits: [B, V] (any float dtype) → LongTensor[B]."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)  # [B]; greedy rows keep it
    V = logits.shape[-1]
    plain = [r for r, p in enumerate(params) if not p.greedy and not p.filters(V)]
    filtered = [r for r, p in enumerate(params) if not p.greedy and p.filters(V)]
    if plain:
        probs = (logits[plain] / _temperatures(params, plain)).softmax(dim=-1)  # [b, V]
        for i, row in enumerate(plain):
            tokens[row] = draw(probs[i], generators[row])
    if filtered:
        probs, order = _sorted_filtered_probs(logits[filtered] / _temperatures(params, filtered),
                                              [params[r] for r in filtered])  # [b, K] each
        for i, row in enumerate(filtered):
            tokens[row] = order[i, draw(probs[i], generators[row])]
    return tokens


def _temperatures(params: list[SamplingParams], rows: list[int]) -> torch.Tensor:
    """The temperatures of `rows` as a column to divide their logits by → [b, 1]."""
    return torch.tensor([params[r].temperature for r in rows])[:, None]


def _sorted_filtered_probs(logits: torch.Tensor,
                           params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Filtered probabilities over each row's best tokens, best first: (probs [B, K], ids [B, K]).

    K is the largest top-k of the batch (the whole vocabulary when some row disables top-k).
    """
    B, V = logits.shape
    top_k = torch.tensor([p.kept_top_k(V) for p in params])  # [B]
    top_p = torch.tensor([p.top_p for p in params])  # [B]
    min_p = torch.tensor([p.min_p for p in params])  # [B]
    K = int(top_k.max())
    if K < V:
        sorted_logits, order = logits.topk(K, dim=-1)  # [B, K], sorted descending
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(K)[None, :]  # [1, K]
    drop = rank >= top_k[:, None]  # top-k, [B, K]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability mass ranked above each
    drop |= mass_before >= top_p[:, None]  # top-p keeps the smallest prefix reaching top_p
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]  # min-p relative to the best token
    drop[:, 0] = False  # the most likely token always survives
    return sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1), order
