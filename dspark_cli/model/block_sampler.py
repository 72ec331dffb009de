"""The draft's sequential half: γ slots sampled left to right once the backbone has run.

Slot k's logits are its base logits plus the Markov bias of the token drawn at slot k−1, so the
slots are drawn one after another; the confidences follow once the block is drawn (no draw depends
on them). Everything here is a pure function of tensors and the head modules, the uniforms drawn
beforehand, so the same function runs eagerly or compiled by TorchInductor (`SlotSampler`): about
25 small ops a slot, ~170 a block, whose per-op dispatch costs more than their arithmetic on a CPU
(the demo's drafter on a 2-core EPYC: 0.87 ms eager, 0.34 compiled for the loop itself).

With top_k > 0 a slot's candidates are its k best base logits and, for the vanilla Markov head,
the k tokens the bias favours after the previous token (`favoured`, a [V, k] table); the bias is
added to those only, and the draft distribution IS the softmax over them (zero elsewhere): exact
for rejection sampling, and W2 is read for 2k rows instead of V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..compiled import CompiledFunction, compiler_found
from .draw import draw_from
from .heads import ConfidenceHead, MarkovHead


@dataclass
class SampledBlock:
    """R drawn blocks: tokens [R, γ] (target ids), their candidates [R, γ, K] (target ids), the
    draft distribution on them [R, γ, K], the drawn candidate [R, γ], confidences [R, γ] or None."""

    tokens: torch.Tensor
    support: torch.Tensor
    probs: torch.Tensor
    index: torch.Tensor
    confidences: torch.Tensor | None


def sample_block(base: torch.Tensor, support: torch.Tensor, full_base: torch.Tensor, anchors: torch.Tensor,
                 hidden: torch.Tensor, uniforms: torch.Tensor, temperature: float,
                 markov: MarkovHead | None, confidence: ConfidenceHead | None,
                 favoured: torch.Tensor | None, token_ids: torch.Tensor | None,
                 truncated: bool) -> tuple[torch.Tensor, ...]:
    """Draw the block: base/support [R, γ, K] (float32 logits, draft ids), full_base [R, γ, N]
    (every draft id's logit), anchors [R], hidden [R, γ, d], uniforms [R, γ] in [0, 1);
    temperature 0 is greedy. `favoured` [V, k] adds the Markov head's favoured tokens to a
    truncated slot's candidates; `token_ids` maps draft ids to target ids (None: the same).

    Returns (tokens, support, probs, index, confidences or None) as `SampledBlock` holds them: a
    tuple, since a compiled function returns tensors."""
    R, gamma = base.shape[0], base.shape[1]
    rows = torch.arange(R, device=base.device)
    prev, state = anchors, None
    tokens, probs, index, supports = [], [], [], []
    for k in range(gamma):
        logits, slot_support = base[:, k], support[:, k]  # [R, K]
        if favoured is not None:
            logits, slot_support = _with_favoured(logits, slot_support, full_base[:, k], favoured[prev])
        if markov is not None:
            z, state = markov.step(prev, hidden[:, k], state)  # [R, r]
            logits = logits + _markov_bias(markov, z, slot_support, full=not truncated)
        if temperature <= 0:
            choice = logits.argmax(-1)  # [R]
            p = F.one_hot(choice, logits.shape[-1]).float()
        else:
            p = torch.softmax(logits / temperature, dim=-1)
            choice = draw_from(p, uniforms[:, k])
        if token_ids is not None:
            slot_support = token_ids[slot_support]
        prev = slot_support[rows, choice]
        tokens.append(prev)
        probs.append(p)
        index.append(choice)
        supports.append(slot_support)
    drafted = torch.stack(tokens, 1)  # [R, γ]
    confidences = None
    if confidence is not None:
        prev_tokens = torch.cat([anchors[:, None], drafted[:, :-1]], 1)  # x_{k-1}: anchor, then drafts
        prev_embed = markov.embed_prev(prev_tokens) if confidence.with_markov else None
        confidences = torch.sigmoid(confidence(hidden, prev_embed)).float()
    return drafted, torch.stack(supports, 1), torch.stack(probs, 1), torch.stack(index, 1), confidences


def _with_favoured(logits: torch.Tensor, support: torch.Tensor, full_base: torch.Tensor,
                   extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the favoured tokens `extra` [R, k] to one slot's candidates: logits/support [R, K]
    (the base top k), full_base [R, N] → [R, K + k]. A favoured token that is already a candidate
    keeps its place and its copy gets probability 0 (-inf logit)."""
    repeated = (extra[:, :, None] == support[:, None, :]).any(-1)  # [R, k]
    extra_logits = full_base.gather(-1, extra).float().masked_fill(repeated, float("-inf"))
    return torch.cat([logits, extra_logits], dim=-1), torch.cat([support, extra], dim=-1)


def _markov_bias(markov: MarkovHead, z: torch.Tensor, support: torch.Tensor, full: bool) -> torch.Tensor:
    """W2·z on the candidates only: z [R, r], support [R, K] → float32 [R, K]."""
    if full:
        return markov.bias(z).float()
    w2 = markov.markov_w2.weight[support]  # [R, K, r]
    return torch.bmm(w2, z.to(w2.dtype).unsqueeze(-1)).squeeze(-1).float()


def compile_wanted(setting: bool | str, device: torch.device) -> bool:
    """Whether target.compile_draft = `setting` compiles: true always, false never, "auto" on CPU
    where a C++ compiler is found (on CUDA the loop is unmeasured compiled)."""
    if isinstance(setting, bool):
        return setting
    return device.type == "cpu" and compiler_found()


class SlotSampler:
    """`sample_block`, compiled (dynamic shapes: any R, context or candidate count) or eager.

    Compiling costs ~20 s on the first draft of a process (TorchInductor caches the kernels on disk
    for later ones); a compile that fails leaves the eager function for the rest of the process
    with one warning, never a failed run."""

    def __init__(self, compiled: bool) -> None:
        self._compiled = CompiledFunction(sample_block, "target.compile_draft", "the draft sampler") \
            if compiled else None

    @property
    def compiling(self) -> bool:
        """Whether drafts take the compiled function (False once it failed)."""
        return self._compiled is not None and not self._compiled.failed

    def __call__(self, *args: object) -> SampledBlock:
        out = self._compiled(*args) if self._compiled is not None else None
        if out is None:
            out = sample_block(*args)
        return SampledBlock(*out)
