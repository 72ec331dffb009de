"""Lossless speculative sampling: accept a drafted token with min(1, p_t/p_d), else resample.

Why exact: for every token x, P(out = x) = min(p_d, p_t)(x) + (1 − Σ min(p_d, p_t)) · r(x) with
r = norm(max(0, p_t − p_d)), which equals p_t(x). Greedy decoding (temperature 0) is the limit
with one-hot distributions: accept iff the drafted token is the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.draw import draw

GREEDY_EPS = 1e-6


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 distribution(s) over the last dim; one-hot argmax when temperature is 0."""
    logits = logits.float()
    if temperature <= GREEDY_EPS:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from a 1-D distribution (argmax when it is one-hot)."""
    return int(draw(probs, generator))


def residual(p_target: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p_t − p_d)); falls back to p_t when the two are equal (reject had prob 0)."""
    diff = (p_target - p_draft).clamp_min(0)
    total = diff.sum()
    return diff / total if total > 0 else p_target


@dataclass
class Verdict:
    """Outcome of verifying one drafted prefix."""

    accepted: int  # drafted tokens accepted (a ≤ ℓ)
    next_token: int  # correction token on rejection, bonus token when all ℓ were accepted
    #: per verified slot: True when accepted (slots after the first rejection are absent).
    accept_flags: list[bool]

    @property
    def tokens_emitted(self) -> int:
        return self.accepted + 1


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
           length: int, generator: torch.Generator | None = None, greedy: bool = False) -> Verdict:
    """Verify the first `length` drafted tokens against the target.

    draft_tokens: [γ] proposed tokens; draft_probs: [γ, V] the distributions they were drawn from;
    target_probs: [length + 1, V], row k is the target's distribution for slot k (row `length`
    gives the bonus token). Rows beyond `length` of the draft are never looked at, so the outcome
    cannot depend on tokens that were not verified.
    """
    if target_probs.shape[0] < length + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, need length + 1 = {length + 1}.")
    flags: list[bool] = []
    for k in range(length):
        token = int(draft_tokens[k])
        p_t, p_d = target_probs[k], draft_probs[k]
        if greedy:
            ok = token == int(p_t.argmax())
        else:
            ratio = float(p_t[token]) / max(float(p_d[token]), 1e-30)
            u = float(torch.rand((), generator=generator))
            ok = u < min(1.0, ratio)
        flags.append(ok)
        if not ok:
            correction = int(p_t.argmax()) if greedy else sample(residual(p_t, p_d), generator)
            return Verdict(k, correction, flags)
    bonus = int(target_probs[length].argmax()) if greedy else sample(target_probs[length], generator)
    return Verdict(length, bonus, flags)
