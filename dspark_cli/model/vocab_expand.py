"""A reduced draft vocabulary served by engines that read no `d2t` (SGLang's DSpark loader).

The drafter proposes only its N draft tokens. vLLM serves that directly (lm_head [N, d] + d2t);
SGLang builds every head over the target's V tokens. So the default export widens the Markov head
by one rank whose W1 column is 1 for every token and whose W2 column is 0 on draft tokens and
−OFF on all others: the bias W2'·W1'[x] is unchanged on the N draft tokens and −OFF (10,000: a
logit no real one comes near, exact in bf16) elsewhere, so softmax gives them exactly zero and
the engine proposes what dspark proposes, from the target's whole lm_head. The confidence head
and the gated head's gate read the new rank through zero weights (the gate's own new row is
saturated open), so they are unchanged too. `contract` inverts it exactly for `load_drafter`.
"""

from __future__ import annotations

import torch

from ..errors import DsparkError
from .config import DrafterConfig

#: The bias a token outside the draft vocabulary gets (bf16 holds 10,000 as 9,984: still exact zero).
OFF = 10_000.0
#: The new gate row's bias: σ(30) is 1 in float32 and bf16.
GATE_OPEN = 30.0
W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
GATE_W, GATE_B = "markov_head.gate_proj.weight", "markov_head.gate_proj.bias"
CONF_W = "confidence_head.proj.weight"
#: Heads whose extra rank is exact (an RNN's state would mix it; vLLM serves neither gated nor RNN).
EXPANDABLE = ("vanilla", "gated")


def expanded_rank(config: DrafterConfig) -> int:
    return config.markov_rank + 1


def expand(tensors: dict[str, torch.Tensor], config: DrafterConfig, draft_ids: torch.Tensor
           ) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of a reduced drafter → the same drafter over the target's vocabulary."""
    if config.markov_head_type not in EXPANDABLE:
        raise DsparkError(f"a {config.markov_head_type} Markov head with a reduced draft vocabulary exports "
                          "only as vLLM's d2t form, which vLLM does not serve for this head.",
                          hint="train reduced vocabularies with model.markov_head_type = vanilla or gated.")
    out = dict(tensors)
    w1, w2 = tensors[W1], tensors[W2]
    vocab, d = config.vocab_size, config.hidden_size
    out[W1] = torch.cat([w1, torch.ones(vocab, 1, dtype=w1.dtype)], dim=1)
    wide = torch.zeros(vocab, w2.shape[1] + 1, dtype=w2.dtype)
    wide[:, -1] = -OFF
    wide[draft_ids] = torch.cat([w2, torch.zeros(w2.shape[0], 1, dtype=w2.dtype)], dim=1)
    out[W2] = wide
    if config.markov_head_type == "gated":
        gw, gb = tensors[GATE_W], tensors[GATE_B]
        gw = torch.cat([gw, torch.zeros(gw.shape[0], 1, dtype=gw.dtype)], dim=1)  # reads e_r through 0
        out[GATE_W] = torch.cat([gw, torch.zeros(1, d + expanded_rank(config), dtype=gw.dtype)])
        out[GATE_B] = torch.cat([gb, torch.full((1,), GATE_OPEN, dtype=gb.dtype)])
    if config.enable_confidence_head and config.confidence_head_with_markov:
        cw = tensors[CONF_W]
        out[CONF_W] = torch.cat([cw, torch.zeros(1, 1, dtype=cw.dtype)], dim=1)
    return out


def contract(tensors: dict[str, torch.Tensor], config: DrafterConfig, where: str
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`expand` undone: (checkpoint tensors, draft ids) from an export folder's tensors."""
    w2 = tensors[W2]
    draft = torch.nonzero(w2[:, -1].float() > -OFF / 2).squeeze(-1)
    if draft.shape[0] != config.draft_vocab_size:
        raise DsparkError(f"{where}: {draft.shape[0]} tokens carry no −{OFF:.0f} bias, the config's draft "
                          f"vocabulary has {config.draft_vocab_size}; not an export of this drafter.")
    out = dict(tensors)
    out[W1] = tensors[W1][:, :-1]
    out[W2] = w2[draft, :-1]
    if config.markov_head_type == "gated":
        out[GATE_W] = tensors[GATE_W][:-1, :-1]
        out[GATE_B] = tensors[GATE_B][:-1]
    if config.enable_confidence_head and config.confidence_head_with_markov:
        out[CONF_W] = tensors[CONF_W][:, :-1]
    return out, draft
