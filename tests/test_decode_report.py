"""Acceptance arithmetic of the eval report: conditional acceptance by position and the τ it implies."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dspark_cli.decode.report import (
    accepted_lengths,
    conversation_ratio_interval,
    cost_line,
    interval_line,
    macro_ratio_interval,
    per_conversation,
    position_acceptance,
    round_cost,
    tau_from_conditional,
    tau_interval,
)
from dspark_cli.decode.specdec import BatchRound, DecodeStats, RoundLog


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


def test_round_cost_splits_a_round_in_target_steps_and_explains_the_speedup_exactly():
    """4 rounds of 2 tokens in 1 s against a baseline at 0.1 s a token: each round costs 2.5 target
    steps, which is the break-even τ, and 2 / 2.5 is the measured speed-up (8 tok/s over 10)."""
    spec = DecodeStats(gamma=7, new_tokens=8, seconds=1.0,
                       batches=[BatchRound(1, 8, 2, None, 0.0) for _ in range(4)],
                       phases={"draft_backbone": 0.1, "draft_heads": 0.05, "draft_context": 0.05,
                               "verify": 0.6, "prefill": 0.1, "schedule": 0.02, "accept": 0.03})
    base = DecodeStats(gamma=0, new_tokens=10, seconds=1.0)
    cost = round_cost(spec, base)
    assert cost["target_step_ms"] == pytest.approx(100.0)
    assert cost["cost_in_target_steps"] == pytest.approx(2.5) and cost["tokens_per_round"] == 2
    assert cost["parts"] == pytest.approx({"draft": 0.5, "verify": 1.5, "prefill": 0.25, "outside": 0.125,
                                           "other": 0.125})
    assert cost["c"] == pytest.approx(0.2 / 0.6)
    speedup = (spec.new_tokens / spec.seconds) / (base.new_tokens / base.seconds)
    assert cost["tokens_per_round"] / cost["cost_in_target_steps"] == pytest.approx(speedup)
    line = cost_line(cost)
    assert "2.50 target steps" in line and "verify 1.50" in line and "0.80×" in line
    assert round_cost(spec, None) is None and round_cost(DecodeStats(gamma=7), base) is None


def test_tau_interval_covers_the_truth_over_conversations_and_narrows_with_them():
    """τ of one dataset, resampled by conversation: covers the population τ in most experiments
    (rounds of one conversation are alike, so fewer conversations give a wider interval)."""
    rng = np.random.default_rng(2)
    truth = (1 + sum(np.mean(rng.beta(2.0, 2.0, 200_000) ** k) for k in range(1, 8)))
    covered, trials = 0, 40
    for _ in range(trials):
        _, record = _experiment(rng, 20)  # the side whose slots accept with p ~ Beta(2, 2)
        low, high = tau_interval(record, draws=300)
        point = (sum(record["accepted"]) + sum(record["rounds"])) / sum(record["rounds"])
        assert low <= point <= high
        covered += low <= truth <= high
    assert covered / trials >= 0.8
    few, many = (tau_interval(_experiment(rng, n)[1], draws=400) for n in (8, 160))
    assert many[1] - many[0] < 0.5 * (few[1] - few[0])
    assert tau_interval({"ids": ["a"], "rounds": [5], "accepted": [3]}) is None


def test_interval_line_turns_the_tau_interval_into_speedups_at_the_round_cost():
    assert interval_line([1.5, 1.8], 8, 1.5) == ("τ 1.50–1.80 (95% over 8 conversations): "
                                                 "speed-up 1.00–1.20× at this round cost")
    assert interval_line([1.5, 1.8], 8, None).endswith("conversations)")
