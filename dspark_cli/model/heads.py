"""The sequential heads on top of the parallel backbone: Markov bias and confidence.

The backbone emits base logits U_k for every slot at once; a Markov head adds a low-rank bias that
depends on the previous token, so the block is sampled left to right (DESIGN.md §3):

    vanilla  z_k = W1[x_{k-1}]                              logits_k = U_k + W2·z_k
    gated    z_k = σ(G·h_k + g) ⊙ W1[x_{k-1}]               (the backbone state decides which
                                                             transition directions apply)
    rnn      z_k = GRU(W1[x_{k-1}], z_{k-1}), z_{-1} = 0    (the bias sees the whole block prefix)

x_{-1} is the anchor. Our reading of the paper's Eq. 6: the gated head gates the rank-r transition
feature per dimension from h_k; the RNN head replaces the one-token transition by a GRU state over
the block prefix, read out by the same W2. Heads return the rank-r feature z; `markov_w2` maps it
to the vocabulary, so the vocabulary-wide product can be computed in chunks by the caller.

Confidence: c_k = σ(w·[h_k; W1[x_{k-1}]] + b) (or w·h_k + b), the probability slot k is accepted
given slots < k were.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import DrafterConfig


class MarkovHead(nn.Module):
    """W1 / W2 low-rank transition bias with the vanilla, gated or RNN state (see module doc)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.kind = config.markov_head_type
        r = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, r)
        self.markov_w2 = nn.Linear(r, config.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate = nn.Linear(config.hidden_size, r, bias=True)
        elif self.kind == "rnn":
            self.rnn = nn.GRUCell(r, r)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as a no-op: the backbone's logits rule first

    def embed_prev(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: [..., γ] token ids → [..., γ, r]."""
        return self.markov_w1(prev_tokens)

    def features(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced z for a whole block: prev_tokens [N, γ], hidden [N, γ, d] → [N, γ, r]."""
        e = self.embed_prev(prev_tokens)
        if self.kind == "vanilla":
            return e
        if self.kind == "gated":
            return torch.sigmoid(self.gate(hidden)) * e
        state = e.new_zeros(e.shape[0], e.shape[2])
        outs = []
        for k in range(e.shape[1]):
            state = self.rnn(e[:, k], state)
            outs.append(state)
        return torch.stack(outs, dim=1)

    def step(self, prev_token: torch.Tensor, hidden: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot at sampling time: prev_token [B], hidden [B, d] → (z [B, r], next state)."""
        e = self.embed_prev(prev_token)
        if self.kind == "vanilla":
            return e, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate(hidden)) * e, None
        state = self.rnn(e, state if state is not None else e.new_zeros(e.shape))
        return state, state

    def bias(self, z: torch.Tensor) -> torch.Tensor:
        """W2·z: [..., r] → [..., V]."""
        return self.markov_w2(z)


class ConfidenceHead(nn.Module):
    """c_k = σ(w·[h_k; W1[x_{k-1}]] + b); returns the logit (BCE-with-logits is the stable loss)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.with_markov = config.confidence_head_with_markov
        in_features = config.hidden_size + (config.markov_rank if self.with_markov else 0)
        self.proj = nn.Linear(in_features, 1, bias=True)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, prev_embed: torch.Tensor | None) -> torch.Tensor:
        """hidden [..., d], prev_embed [..., r] (W1[x_{k-1}]) → confidence logits [...]."""
        x = torch.cat([hidden, prev_embed], dim=-1) if self.with_markov else hidden
        return self.proj(x).squeeze(-1)
