"""Acceptance arithmetic of the eval report: conditional acceptance by position and the τ it implies."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dspark_cli.decode.report import (
    accepted_lengths,
    macro_ratio_interval,
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
