"""Rejection sampling: the output law equals the target's, exactly (formula) and empirically."""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark_cli.decode.audit import chi_square
from dspark_cli.decode.sampling import probs_from_logits, residual, verify

P_T = torch.tensor([0.5, 0.2, 0.2, 0.1])
P_D = torch.tensor([0.1, 0.6, 0.1, 0.2])


def test_residual_is_normalised_positive_part():
    r = residual(P_T, P_D)
    expected = torch.tensor([0.4, 0.0, 0.1, 0.0]) / 0.5
    assert torch.allclose(r, expected)
    assert torch.equal(residual(P_T, P_T), P_T)  # nothing to resample from: never used, but valid


def test_acceptance_plus_residual_reconstructs_target_exactly():
    accept = torch.minimum(torch.ones(4), P_T / P_D)  # per drafted token
    beta = (P_D * accept).sum()
    law = P_D * accept + (1 - beta) * residual(P_T, P_D)
    assert torch.allclose(law, P_T, atol=1e-7)


def _empirical(n: int, seed: int = 0) -> dict[tuple[int, ...], int]:
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        token = int(torch.multinomial(P_D, 1, generator=gen))
        v = verify(torch.tensor([token]), P_D[None], torch.stack([P_T, P_T]), 1, gen)
        out = token if v.accepted == 1 else v.next_token
        counts[(out,)] = counts.get((out,), 0) + 1
    return counts


def test_verify_output_matches_target_chi_square():
    counts = _empirical(6000)
    _stat, _dof, p = chi_square(counts, {(i,): float(P_T[i]) for i in range(4)})
    assert p > 1e-3
    # and the test has power: the drafter's own law is rejected
    _s, _d, p_wrong = chi_square(counts, {(i,): float(P_D[i]) for i in range(4)})
    assert p_wrong < 1e-10


def test_two_slot_block_joint_law_matches_markov_target():
    """Slots 0 and 1 verified against a Markov target; first two emitted tokens ~ p_t(x1) p_t(x2|x1)."""
    target = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.4, 0.3]])  # rows: previous token
    draft = torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.3, 0.2], [0.3, 0.3, 0.4]])
    gen = torch.Generator().manual_seed(1)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(6000):
        x1 = int(torch.multinomial(draft[0], 1, generator=gen))
        x2 = int(torch.multinomial(draft[x1], 1, generator=gen))
        v = verify(torch.tensor([x1, x2]), torch.stack([draft[0], draft[x1]]),
                   torch.stack([target[0], target[x1], target[x2]]), 2, gen)
        out = [x1, x2][: v.accepted] + [v.next_token]
        if len(out) < 2:  # rejected at slot 0: the second token comes from the target itself
            out.append(int(torch.multinomial(target[out[0]], 1, generator=gen)))
        key = tuple(out[:2])
        counts[key] = counts.get(key, 0) + 1
    expected = {(a, b): float(target[0, a] * target[a, b]) for a, b in itertools.product(range(3), repeat=2)}
    assert chi_square(counts, expected)[2] > 1e-3


def test_bonus_token_when_all_accepted_and_unverified_rows_unread():
    one_hot = torch.eye(3)
    nan = torch.full((3,), float("nan"))
    gen = torch.Generator().manual_seed(0)
    v = verify(torch.tensor([1, 2, 0]), torch.stack([one_hot[1], one_hot[2], nan]),
               torch.stack([one_hot[1], one_hot[2], one_hot[0]]), 2, gen)
    assert (v.accepted, v.next_token, v.accept_flags) == (2, 0, [True, True])
    assert v.tokens_emitted == 3
    v0 = verify(torch.tensor([1]), nan[None], one_hot[2:3], 0, gen)  # ℓ = 0: the target's own token
    assert (v0.accepted, v0.next_token) == (0, 2)


def test_greedy_accepts_iff_argmax_and_corrects_with_argmax():
    target_logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    p_t = probs_from_logits(target_logits, 0.0)
    assert torch.equal(p_t, torch.tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, 1]]))
    draft_probs = probs_from_logits(torch.randn(2, 3), 0.0)
    v = verify(torch.tensor([1, 2]), draft_probs, p_t, 2, greedy=True)
    assert (v.accepted, v.next_token) == (1, 0)  # slot 1 wanted 0, drafted 2
    v = verify(torch.tensor([1, 0]), draft_probs, p_t, 2, greedy=True)
    assert (v.accepted, v.next_token) == (2, 2)


def test_verify_rejects_short_target():
    with pytest.raises(ValueError, match="length"):
        verify(torch.tensor([0, 1]), torch.ones(2, 2) / 2, torch.ones(2, 2) / 2, 2)
