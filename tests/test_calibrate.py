"""STS and the calibration metrics: hand cases, and synthetic miscalibrated confidences."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_cli.decode.calibrate import (
    RoundRecords,
    apply_temperatures,
    brier,
    ece,
    fit_sts,
    roc_auc,
    scale,
    temperature_grid,
)
from dspark_cli.decode.plots import reliability_plot


def test_ece_brier_auc_hand_cases():
    probs = np.array([0.1, 0.1, 0.9, 0.9])
    labels = np.array([0, 1, 1, 1])
    # bin of 0.1: mean label 0.5 vs 0.1 → 0.4·2/4; bin of 0.9: 1.0 vs 0.9 → 0.1·2/4
    assert ece(probs, labels, bins=10) == pytest.approx(0.25)
    assert brier(probs, labels) == pytest.approx((0.01 + 0.81 + 0.01 + 0.01) / 4)
    assert roc_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert roc_auc(np.array([0.5, 0.5]), np.array([0, 1])) == pytest.approx(0.5)  # ties count half
    assert roc_auc(np.array([0.2, 0.3]), np.array([1, 1])) is None


def test_scale_and_temperature_grid():
    c = np.array([[0.5, 0.9, 0.2]])
    assert np.allclose(scale(c, [1.0, 1.0, 1.0]), c)
    assert scale(c, [2.0, 2.0, 2.0])[0, 1] < 0.9  # T > 1 softens toward 0.5
    assert scale(c, [0.5, 0.5, 0.5])[0, 2] < 0.2  # T < 1 sharpens
    assert apply_temperatures([0.5, 0.9], [3.0, 1.0]) == pytest.approx([0.5, 0.9])
    grid = temperature_grid(0.1, 10, 7)
    assert 1.0 in grid and grid[0] == pytest.approx(0.1) and grid[-1] == pytest.approx(10)


def _overconfident(n: int = 3000, gamma: int = 4, power: float = 3.0, seed: int = 0) -> RoundRecords:
    """True per-slot acceptance q; the head reports σ(power·logit(q)): overconfident by `power`."""
    rng = np.random.default_rng(seed)
    q = rng.uniform(0.2, 0.97, (n, gamma))
    accepted_slot = rng.random((n, gamma)) < q
    accepted = np.argmin(np.concatenate([accepted_slot, np.zeros((n, 1), bool)], 1), axis=1)
    raw = scale(q, [1 / power] * gamma)
    return RoundRecords(raw, np.full(n, gamma), accepted)


def test_sts_recovers_temperature_lowers_ece_and_keeps_order():
    rec = _overconfident()
    fit = fit_sts(rec, t_min=0.1, t_max=10.0, t_steps=120)
    assert fit.ece_after < 0.5 * fit.ece_before
    assert all(p["ece_after"] <= p["ece_before"] for p in fit.per_position)
    assert fit.temperatures[0] == pytest.approx(3.0, rel=0.25)  # slot 1 alone: the true factor
    assert all(t > 1.0 for t in fit.temperatures)
    # Temperature scaling is monotone per slot: the order of confidences is unchanged.
    cal = scale(rec.confidences, fit.temperatures)
    for k in range(rec.gamma):
        order = np.argsort(rec.confidences[:, k], kind="stable")
        assert np.array_equal(order, np.argsort(cal[:, k], kind="stable"))
    assert fit.per_position[0]["roc_auc_after"] == pytest.approx(fit.per_position[0]["roc_auc_before"])


def test_sts_leaves_calibrated_confidences_near_one():
    fit = fit_sts(_overconfident(power=1.0, seed=1), t_min=0.1, t_max=10.0, t_steps=120)
    assert fit.temperatures[0] == pytest.approx(1.0, rel=0.25)
    assert fit.ece_after <= fit.ece_before + 1e-9


def test_unobserved_slots_are_excluded():
    # Round 0 verified 1 slot and accepted it: slot 2's prefix acceptance is unknown.
    rec = RoundRecords.from_lists([[0.9, 0.9], [0.9, 0.9]], verified=[1, 2], accepted=[1, 0])
    assert rec.observed().tolist() == [[True, False], [True, True]]
    assert rec.prefix_accepted().tolist() == [[True, False], [False, False]]


def test_reliability_plot_writes_png(memory_url):
    from dspark_cli import storage

    rec = _overconfident(n=300)
    url = memory_url + "/rel.png"
    reliability_plot(rec, [2.0, 2.0, 2.0, 2.0], url)
    assert storage.read_bytes(url)[:8] == b"\x89PNG\r\n\x1a\n"
