"""The sequential heads on top of the parallel backbone: Markov bias and confidence.

The backbone emits base logits U_k for every slot at once; a Markov head adds a low-rank bias that
depends on the previous token, so the block is sampled left to right (DESIGN.md §3). The three
kinds are the ones DeepSpec trains and SGLang serves, with the same parameter names, so an export
loads there unchanged (vLLM serves vanilla only):

    e_k = W1[x_{k-1}]                                   x_{-1} is the anchor
    vanilla  z_k = e_k
    gated    z_k = σ(gate_proj([h_k; e_k])) ⊙ e_k       gate_proj: Linear(H + r → r), bias
    rnn      [g, c, o] = joint_proj([s_{k-1}; e_k; h_k])  joint_proj: Linear(2r + H → 3r), bias
             s_k = σ(g)⊙s_{k-1} + (1−σ(g))⊙tanh(c),  s_0 = 0,  z_k = tanh(o)
    logits_k = U_k + W2·z_k

h_k is the slot's final (normed) backbone state, the one the lm_head reads. Heads return the
rank-r feature z; `markov_w2` maps it to the vocabulary, so the vocabulary-wide product can be
computed in chunks by the caller.

Confidence: c_k = σ(w·[h_k; W1[x_{k-1}]] + b) (or w·h_k + b), the probability slot k is accepted
given slots < k were.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DsparkError
from .config import DrafterConfig


class MarkovHead(nn.Module):
    """W1 / W2 low-rank transition bias with the vanilla, gated or RNN state (see module doc)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.kind = config.markov_head_type
        r, d = config.markov_rank, config.hidden_size
        self.rank = r
        self.markov_w1 = nn.Embedding(config.vocab_size, r)
        self.markov_w2 = nn.Linear(r, config.draft_vocab, bias=False)  # logits of the draft vocabulary
        if self.kind == "gated":
            self.gate_proj = nn.Linear(d + r, r, bias=True)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + d, 3 * r, bias=True)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as a no-op: the backbone's logits rule first

    def embed_prev(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: [..., γ] token ids → [..., γ, r]."""
        return self.markov_w1(prev_tokens)

    def _rnn(self, state: torch.Tensor, e: torch.Tensor,
             h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One RNN step: (s_{k-1}, e_k, h_k) → (z_k, s_k)."""
        g, c, o = self.joint_proj(torch.cat([state, e, h.to(e.dtype)], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        return torch.tanh(o), g * state + (1.0 - g) * torch.tanh(c)

    def features(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced z for a whole block: prev_tokens [N, γ], hidden [N, γ, d] → [N, γ, r]."""
        e = self.embed_prev(prev_tokens)
        if self.kind == "vanilla":
            return e
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden.to(e.dtype), e], dim=-1))) * e
        state = e.new_zeros(e.shape[0], self.rank)
        outs = []
        for k in range(e.shape[1]):
            z, state = self._rnn(state, e[:, k], hidden[:, k])
            outs.append(z)
        return torch.stack(outs, dim=1)

    def step(self, prev_token: torch.Tensor, hidden: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot at sampling time: prev_token [B], hidden [B, d] → (z [B, r], next state)."""
        e = self.embed_prev(prev_token)
        if self.kind == "vanilla":
            return e, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden.to(e.dtype), e], dim=-1))) * e, None
        return self._rnn(state if state is not None else e.new_zeros(e.shape), e, hidden)

    def bias(self, z: torch.Tensor) -> torch.Tensor:
        """W2·z: [..., r] → [..., V] (V: the draft vocabulary)."""
        return self.markov_w2(z)

    def favoured_after(self, prev_tokens: torch.Tensor, k: int) -> torch.Tensor:
        """The k tokens the vanilla bias raises most after each previous token: [B] → [B, k]."""
        return self.favoured_table(k)[prev_tokens.to(self.markov_w1.weight.device)]

    @torch.inference_mode()  # the kept table is then always an inference tensor, updatable in any mode
    def favoured_table(self, k: int) -> torch.Tensor:
        """Row x: the k draft ids the vanilla bias raises most after token x, LongTensor [V, k].

        The vanilla bias W2·W1[x] depends on the previous token alone, so its top k is a property
        of the token: the table for the whole vocabulary is computed on first use (W1·W2ᵀ a
        block of rows at a time, ~4 s for SmolLM2's 49152 on 2 cores; one token at a time cost
        1.5 ms a miss, 1-3 ms a decoding round) and kept while the weights stay the same. A draft
        that takes its candidates from the base logits alone misses the tokens only the Markov
        bias favours (docs/eval.md)."""
        if self.kind != "vanilla":
            raise ValueError(f"only the vanilla Markov bias depends on the previous token alone, "
                             f"not {self.kind!r}.")
        w1, w2 = self.markov_w1.weight, self.markov_w2.weight
        key = (k, w1.data_ptr(), w1._version, w2.data_ptr(), w2._version)
        if getattr(self, "_favoured_key", None) != key:
            self._favoured = self._favoured_table(k)
            self._favoured_key = key
        return self._favoured

    def _favoured_table(self, k: int, rows_per_block: int = 1024) -> torch.Tensor:
        """topk(W1·W2ᵀ, k) per row → LongTensor [V, k], without a [V, V] product in memory."""
        w1, w2 = self.markov_w1.weight, self.markov_w2.weight
        table = torch.empty(w1.shape[0], k, dtype=torch.long, device=w1.device)
        w2t = w2.t().contiguous()  # [r, V]: a plain NN product, reused by every block
        for start in range(0, w1.shape[0], rows_per_block):
            block = w1[start:start + rows_per_block].to(w2t.dtype) @ w2t  # [n, V]
            table[start:start + rows_per_block] = block.topk(k, dim=-1).indices
        return table


def upgrade_legacy_markov(tensors: dict[str, torch.Tensor], kind: str, where: str) -> dict[str, torch.Tensor]:
    """Read checkpoints written before the heads matched DeepSpec/SGLang.

    The old gated head, σ(G·h + g) ⊙ e, is exactly the new one with gate_proj = [G | 0] and bias g,
    so it converts losslessly. The old RNN head (a GRU over e) has no equivalent: it is refused.
    """
    if kind == "gated" and "markov_head.gate.weight" in tensors:
        tensors = dict(tensors)
        weight = tensors.pop("markov_head.gate.weight")
        r = weight.shape[0]
        tensors["markov_head.gate_proj.weight"] = torch.cat([weight, weight.new_zeros(r, r)], dim=1)
        tensors["markov_head.gate_proj.bias"] = tensors.pop("markov_head.gate.bias")
    elif kind == "rnn" and any(k.startswith("markov_head.rnn.") for k in tensors):
        raise DsparkError(f"{where}: its RNN Markov head is the old GRU form, which no engine serves and "
                          "which has no exact equivalent in the DeepSpec/SGLang RNN head.",
                          hint="retrain with this release (model.markov_head_type=rnn), or use vanilla.")
    return tensors


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
