"""Lossless speculative sampling: accept a drafted token with min(1, p_t/p_d), else resample.

Why exact: for every token x, P(out = x) = min(p_d, p_t)(x) + (1 − Σ min(p_d, p_t)) · r(x) with
r = norm(max(0, p_t − p_d)), which equals p_t(x). p_d can be any distribution the token was
really drawn from: the drafter's is the softmax over its top-k candidates only (zero elsewhere),
and the residual is then p_t itself outside them. Greedy decoding (temperature 0) is the limit
with one-hot distributions: accept iff the drafted token is the target's argmax.

`verify_rounds` verifies R requests at once where the logits are (no vocabulary-wide copy leaves
the device): log-sum-exp per slot, the target's probability of each drafted token, one uniform
per slot, and one full-vocabulary row per request for the correction or bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.draw import DraftDist, draw

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
    """norm(max(0, p_t − p_d)) per row; p_t where the two are equal (reject had prob 0)."""
    diff = (p_target - p_draft).clamp_min(0)
    total = diff.sum(-1, keepdim=True)
    return torch.where(total > 0, diff / total.clamp_min(1e-30), p_target)


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


def verify_rounds(draft: DraftDist, target_logits: torch.Tensor, lengths: torch.Tensor,
                  temperature: float, generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify request r's first lengths[r] drafted tokens against the target, all R at once.

    target_logits [R, L, V] (L ≥ max ℓ + 1; row k is the target at slot k, row ℓ_r the bonus).
    Returns (accepted [R], next_token [R]) on the logits' device. Slots at or beyond ℓ_r are
    never read into the outcome, so it cannot depend on tokens that were not verified.
    """
    R, L, V = target_logits.shape
    lengths = lengths.to(target_logits.device)
    if bool((lengths + 1 > L).any()):
        raise ValueError(f"target_logits has {L} rows per request, need length + 1 = "
                         f"{int(lengths.max()) + 1}.")
    G = min(L - 1, draft.tokens.shape[1])  # slots anyone verifies
    slot = torch.arange(G, device=target_logits.device)
    live = slot[None, :] < lengths[:, None]  # [R, G]
    tokens = draft.tokens[:, :G].to(target_logits.device)
    rows = torch.arange(R, device=target_logits.device)
    if temperature <= GREEDY_EPS:
        best = target_logits.argmax(-1)  # [R, L]
        ok = (tokens == best[:, :G]) & live
        accepted = ok.long().cumprod(-1).sum(-1)
        return accepted, best[rows, accepted]
    logits = target_logits.float() / temperature
    lse = torch.logsumexp(logits[:, :G], dim=-1)  # [R, G]
    p_tok = torch.exp(logits[:, :G].gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse)
    q_tok = draft.token_probs()[:, :G].to(p_tok.device)
    device = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand((R, G), generator=generator, device=device).to(p_tok.device)
    ok = (u * q_tok < p_tok) & live  # u < min(1, p_t/p_d), without dividing by p_d
    accepted = ok.long().cumprod(-1).sum(-1)  # [R]
    p_next = torch.softmax(logits[rows, accepted], dim=-1)  # [R, V]
    rejected = accepted < lengths
    if bool(rejected.any()):
        r = rows[rejected]
        q = draft.dense_row(r, accepted[rejected], V).to(p_next.device)
        p_next[r] = residual(p_next[r], q)
    return accepted, draw(p_next, generator)


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
           length: int, generator: torch.Generator | None = None, greedy: bool = False) -> Verdict:
    """One request: `verify_rounds` with dense distributions (the audit's and the tests' form).

    draft_tokens: [γ] proposed tokens; draft_probs: [γ, V] the distributions they were drawn from;
    target_probs: [length + 1, V], row k is the target's distribution for slot k.
    """
    if target_probs.shape[0] < length + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, need length + 1 = {length + 1}.")
    draft = DraftDist.dense(draft_tokens[None].long(), torch.nan_to_num(draft_probs.float())[None])
    accepted, token = verify_rounds(draft, torch.log(target_probs[None, : length + 1].float()),
                                    torch.tensor([length]), 0.0 if greedy else 1.0, generator)
    a = int(accepted[0])
    return Verdict(a, int(token[0]), [True] * a + ([False] if a < length else []))
