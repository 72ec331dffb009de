"""Acceptance arithmetic of the eval report: conditional acceptance by position and the τ it implies."""

from __future__ import annotations

import random

import pytest

from dspark_cli.decode.report import position_acceptance, tau_from_conditional
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
