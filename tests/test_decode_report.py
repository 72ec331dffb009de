"""Acceptance arithmetic of the eval report: conditional acceptance by position and the τ it implies."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dspark_cli.decode.report import (
    accepted_lengths,
    conversation_ratio_interval,
    macro_ratio_interval,
    per_conversation,
    position_acceptance,
    tau_from_conditional,
)
from dspark_cli.decode.specdec import DecodeStats, RoundLog


def test_tau_from_conditional_hand_cases():
    assert tau_from_conditional([1.0] * 7) == pytest.approx(8.0)
    assert tau_from_conditional([0.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert tau_from_conditional([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    # never-reached positions add nothing; `first` replaces only position 1
    assert tau_from_conditional([0.5, None, 1.0]) == pytest.approx(1.5)
    assert tau_from_conditional([0.1, 0.5], first=1.0) == pytest.approx(1 + 1 + 0.5)


def test_tau_from_measured_conditionals_equals_measured_tau():
    """With every round verifying all γ slots, the product of conditionals is exact, not a model."""
    rng = random.Random(0)
    gamma = 7
    stats = DecodeStats(gamma=gamma)
    for _ in range(500):
        accepted = 0
        while accepted < gamma and rng.random() < (0.6 if accepted else 0.3):
            accepted += 1
        stats.rounds.append(RoundLog(verified=gamma, accepted=accepted, confidences=None))
    measured = sum(r.accepted + 1 for r in stats.rounds) / len(stats.rounds)
    conditional = position_acceptance(stats)["conditional"]
    assert tau_from_conditional(conditional) == pytest.approx(measured)
    assert tau_from_conditional(conditional, first=1.0) > measured


def _stats(p_first: float, p_later: float, rounds: int, seed: int, gamma: int = 7) -> DecodeStats:
    rng = random.Random(seed)
    stats = DecodeStats(gamma=gamma)
    for _ in range(rounds):
        accepted = 0
        while accepted < gamma and rng.random() < (p_later if accepted else p_first):
            accepted += 1
        stats.rounds.append(RoundLog(verified=gamma, accepted=accepted, confidences=None))
    return stats


def test_accepted_lengths_rebuild_every_round_from_the_position_counts():
    stats = _stats(0.3, 0.6, 400, seed=1)
    lengths = accepted_lengths(position_acceptance(stats), len(stats.rounds))
    assert sorted(lengths.tolist()) == sorted(r.accepted for r in stats.rounds)


def test_macro_ratio_interval_holds_the_point_and_narrows_with_rounds():
    def lengths(p_first: float, rounds: int, seed: int) -> np.ndarray:
        stats = _stats(p_first, 0.5, rounds, seed)
        return accepted_lengths(position_acceptance(stats), rounds)

    few = macro_ratio_interval([lengths(0.4, 200, 1)], [lengths(0.3, 200, 2)], draws=400)
    many = macro_ratio_interval([lengths(0.4, 5000, 3)], [lengths(0.3, 5000, 4)], draws=400)
    true_ratio = tau_from_conditional([0.4] + [0.5] * 6) / tau_from_conditional([0.3] + [0.5] * 6)
    assert many[0] < true_ratio < many[1]
    assert many[1] - many[0] < 0.5 * (few[1] - few[0])


def test_per_conversation_sums_rounds_of_interleaved_requests():
    stats = DecodeStats(gamma=3)
    for conv, accepted in (("a", 2), ("b", 0), ("a", 3), ("c", 1), ("b", 1)):
        stats.rounds.append(RoundLog(verified=3, accepted=accepted, confidences=None, conversation=conv))
    assert per_conversation(stats) == {"ids": ["a", "b", "c"], "rounds": [2, 2, 1], "accepted": [5, 1, 1]}


def _experiment(rng: np.random.Generator, conversations: int, rounds: int = 30,
                gamma: int = 7) -> tuple[dict, dict]:
    """Both drafters on the same conversations; each conversation has its own difficulty and its
    own gain of one drafter over the other, so its rounds are alike (as real ones are) and rounds
    are not independent draws."""
    def decode(p: np.ndarray) -> dict:
        slots = rng.random((conversations, rounds, gamma)) < p[:, None, None]
        accepted = np.cumprod(slots, axis=2).sum(axis=2)  # [conv, rounds]
        return {"ids": [f"c{i}" for i in range(conversations)], "rounds": [rounds] * conversations,
                "accepted": accepted.sum(axis=1).tolist(), "lengths": accepted.ravel()}

    difficulty, lift = rng.beta(2.0, 2.0, conversations), rng.normal(0.08, 0.15, conversations)
    return decode(np.clip(difficulty + lift, 0.0, 1.0)), decode(difficulty)


def _true_ratio(gamma: int = 7) -> float:
    rng = np.random.default_rng(123)
    d, lift = rng.beta(2.0, 2.0, 200_000), rng.normal(0.08, 0.15, 200_000)
    tau = [1 + sum(np.mean(p ** k) for k in range(1, gamma + 1)) for p in (np.clip(d + lift, 0, 1), d)]
    return tau[0] / tau[1]


def test_conversation_bootstrap_covers_the_truth_where_the_round_bootstrap_does_not():
    rng = np.random.default_rng(0)
    truth = _true_ratio()
    covered_conv = covered_round = 0
    trials = 40
    for _ in range(trials):
        (num_a, den_a), (num_b, den_b) = _experiment(rng, 20), _experiment(rng, 20)
        low, high = conversation_ratio_interval([num_a, num_b], [den_a, den_b], draws=300)
        point = ((sum(num_a["accepted"]) / 600 + 1 + sum(num_b["accepted"]) / 600 + 1)
                 / (sum(den_a["accepted"]) / 600 + 1 + sum(den_b["accepted"]) / 600 + 1))
        assert low <= point <= high
        covered_conv += low <= truth <= high
        low, high = macro_ratio_interval([num_a["lengths"], num_b["lengths"]],
                                         [den_a["lengths"], den_b["lengths"]], draws=300)
        covered_round += low <= truth <= high
    assert covered_conv / trials >= 0.85
    assert covered_round / trials <= covered_conv / trials - 0.2


def test_conversation_bootstrap_pairs_by_id_and_narrows_with_conversations():
    rng = np.random.default_rng(1)
    few = conversation_ratio_interval(*([x] for x in _experiment(rng, 10)), draws=400)
    many = conversation_ratio_interval(*([x] for x in _experiment(rng, 160)), draws=400)
    assert many[1] - many[0] < 0.5 * (few[1] - few[0])
    num, den = _experiment(rng, 12)
    shuffled = {k: list(reversed(den[k])) for k in ("ids", "rounds", "accepted")}  # same data, other order
    assert conversation_ratio_interval([num], [shuffled], draws=300) == \
        conversation_ratio_interval([num], [den], draws=300)
    with pytest.raises(ValueError, match="share no conversation"):
        conversation_ratio_interval([num], [{"ids": ["x"], "rounds": [1], "accepted": [0]}])
