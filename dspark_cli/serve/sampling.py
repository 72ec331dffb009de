"""Per-request sampling over a batch of logits: temperature, top-k, top-p, min-p, seeded draws.

Rows of one forward batch belong to different requests, so every knob is a per-row tensor and
every row draws from its own `torch.Generator` (a request's `seed` reproduces its output no matter
which other requests shared the batch). The filter order is the Transformers one:
temperature → top-k → top-p → min-p.

Speed matters on CPU (one call per decoding step for the whole batch): the filters run on the
`k` best logits only (`topk` instead of a full vocabulary sort when every row sets top-k), and a
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


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> torch.Tensor:
    """Next token per row. logits: [B, V] (any float dtype) → LongTensor[B]."""
    logits = logits.float()
    greedy = [p.greedy for p in params]
    tokens = logits.argmax(dim=-1)  # [B]
    if all(greedy):
        return tokens
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
    probs, order = _sorted_filtered_probs(logits / temperature[:, None], params)  # [B, K] each
    for row, gen in enumerate(generators):
        if not greedy[row]:
            tokens[row] = order[row, draw(probs[row], gen)]
    return tokens


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after top-k, top-p and min-p masking. logits: [B, V] float32 → probs [B, V]."""
    probs, order = _sorted_filtered_probs(logits, params)
    return torch.zeros_like(logits).scatter_(-1, order, probs)


def _sorted_filtered_probs(logits: torch.Tensor,
                           params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Filtered probabilities over each row's best tokens, best first: (probs [B, K], ids [B, K]).

    K is the largest top-k of the batch (the whole vocabulary when some row disables top-k).
    """
    B, V = logits.shape
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params])  # [B]
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
