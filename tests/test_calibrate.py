"""STS and the calibration metrics: hand cases, and synthetic miscalibrated confidences."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_cli.decode.calibrate import (
    BOUNDARY,
    FITTED,
    NO_GAIN,
    TOO_FEW,
    RoundRecords,
    apply_temperatures,
    brier,
    calibration_file,
    cross_fit,
    ece,
    fit_sts,
    position_ece,
    roc_auc,
    scale,
    summary,
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


def _overconfident(n: int = 3000, gamma: int = 4, power: float = 3.0, seed: int = 0,
                   q_range: tuple[float, float] = (0.2, 0.97), per_conversation: int = 10) -> RoundRecords:
    """True per-slot acceptance q; the head reports σ(power·logit(q)): overconfident by `power`.
    Rounds come `per_conversation` at a time from one conversation."""
    rng = np.random.default_rng(seed)
    q = rng.uniform(*q_range, (n, gamma))
    accepted_slot = rng.random((n, gamma)) < q
    accepted = np.argmin(np.concatenate([accepted_slot, np.zeros((n, 1), bool)], 1), axis=1)
    raw = scale(q, [1 / power] * gamma)
    groups = np.array([f"c{i // per_conversation}" for i in range(n)], dtype=object)
    return RoundRecords(raw, np.full(n, gamma), accepted, groups)


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


def test_position_with_few_prefixes_keeps_t1_where_an_unguarded_fit_runs_to_the_grid_edge():
    # The demo's failure: slots 3-4 almost never accepted, so their few labels are nearly all 0.
    rec = _overconfident(n=600, gamma=4, power=1.0, seed=3, q_range=(0.05, 0.6))
    counts = [int(rec.prefix_accepted()[:, k].sum()) for k in range(rec.gamma)]
    assert counts[0] >= 30 and counts[3] < 30
    unguarded = fit_sts(rec, t_min=0.05, t_max=10.0, t_steps=120, min_prefixes=1)
    assert unguarded.status[3] == BOUNDARY or unguarded.temperatures[3] < 0.2  # what it did before
    # The head is calibrated (power 1), so the held-out check would rightly undo the fit: off here.
    fit = fit_sts(rec, t_min=0.05, t_max=10.0, t_steps=120, min_prefixes=30, held_out_check=False)
    for k, n in enumerate(counts):
        if n < 30:
            assert fit.temperatures[k] == 1.0 and fit.status[k] == TOO_FEW and not fit.fitted[k]
    assert fit.status[0] == FITTED and fit.per_position[0]["fitted"]
    assert fit.per_position[3]["accepted_prefixes"] == counts[3]


def test_temperature_on_the_grid_edge_is_not_shipped():
    # Perfectly separable slot: the ECE keeps falling as T → 0 (confidences → 0/1), so the
    # best grid point is the floor; that is a degenerate fit, not a temperature.
    rng = np.random.default_rng(0)
    n = 400
    accepted = (np.arange(n) % 10 < 7).astype(np.int64)  # 70% accepted
    conf = np.stack([np.where(accepted == 1, rng.uniform(0.55, 0.9, n), rng.uniform(0.1, 0.45, n)),
                     np.full(n, 0.5)], axis=1)
    rec = RoundRecords(conf, np.full(n, 2), accepted)
    fit = fit_sts(rec, t_min=0.05, t_max=10.0, t_steps=60, min_prefixes=30)
    assert fit.status[0] == BOUNDARY and fit.temperatures[0] == 1.0
    grid = temperature_grid(0.05, 10.0, 60)
    assert all(t == 1.0 or grid[0] < t < grid[-1] for t in fit.temperatures)


def test_folds_split_by_conversation_and_alternate():
    rec = _overconfident(n=95, per_conversation=10)
    a, b = rec.folds()
    assert a.sum() + b.sum() == 95 and not (a & b).any()
    assert not set(rec.groups[a]) & set(rec.groups[b])
    assert set(rec.groups[a]) == {f"c{i}" for i in range(0, 10, 2)}
    halves = RoundRecords(rec.confidences, rec.verified, rec.accepted).folds()[0]
    assert halves.tolist() == [i < 47 for i in range(95)]


def test_cross_fit_scores_each_fold_with_the_other_folds_temperatures():
    rec = _overconfident(n=2000, power=2.5, seed=5)
    cross = cross_fit(rec, t_min=0.1, t_max=10.0, t_steps=80)
    a, b = rec.folds()
    for fit_on, temps in ((a, cross.fold_temperatures[0]), (b, cross.fold_temperatures[1])):
        assert temps == fit_sts(rec.subset(fit_on), t_min=0.1, t_max=10.0, t_steps=80).temperatures
    ea, na = position_ece(rec.subset(a), cross.fold_temperatures[1])
    eb, nb = position_ece(rec.subset(b), cross.fold_temperatures[0])
    assert cross.ece_after == pytest.approx(((ea * na + eb * nb) / (na + nb)).tolist())
    assert cross.samples == (na + nb).tolist() and cross.fold_rounds == [int(a.sum()), int(b.sum())]
    assert cross.fold_conversations == [100, 100]
    # Out of sample STS still helps an overconfident head, but less than in sample says.
    fit = fit_sts(rec, t_min=0.1, t_max=10.0, t_steps=80)
    assert cross.pooled_after < 0.5 * cross.pooled_before
    assert cross.pooled_after > fit.ece_after
    assert cross_fit(rec.subset(rec.groups == "c0")) is None  # one conversation: no second fold


def test_calibration_file_has_sglangs_keys_and_types_and_leads_with_out_of_sample(memory_url):
    from dspark_cli import storage
    from dspark_cli.decode.stages import load_calibration
    from dspark_cli.schemas import validate

    rec = _overconfident(n=800, gamma=4, power=2.0, seed=2)
    fit, cross = fit_sts(rec), cross_fit(rec)
    obj = calibration_file(fit, cross, dataset="runs/x/prompts", extra={"block_size": 4})
    url = memory_url + "/calibration.json"
    storage.write_json(url, obj)
    obj = storage.read_json(url)
    # SGLang's DSparkStsCalibration (msgspec, strict): exactly these types, one entry per position.
    assert type(obj["dataset"]) is str and type(obj["num_samples"]) is int and obj["num_samples"] == 800
    for key in ("temperatures", "ece_before", "ece_after"):
        assert type(obj[key]) is list and len(obj[key]) == 4
        assert all(type(x) is float for x in obj[key]), key
    assert all(t > 0 for t in obj["temperatures"])
    assert obj["temperatures"] == fit.temperatures  # shipped: fitted on all rounds
    assert obj["ece_after"] == pytest.approx(cross.ece_after) and obj["ece_source"] == "cross_fit"
    assert obj["pooled_ece_after"] == pytest.approx(cross.pooled_after)
    assert obj["in_sample"]["pooled_ece_after"] == pytest.approx(fit.ece_after)
    assert obj["fitted"] == fit.fitted and obj["cross_fit"]["temperatures"] == cross.fold_temperatures
    validate(obj, "calibration")
    assert load_calibration(url, gamma=4) == fit.temperatures
    from dspark_cli.model.engine_check import check_sts

    assert check_sts(obj, 4) == []  # what `dspark export check` says SGLang would do with it
    s = summary(obj)
    assert s["out_of_sample"] and s["ece_after"] == obj["pooled_ece_after"]
    # Without a second fold the lists are the in-sample ones, and the file says so.
    alone = calibration_file(fit, None, dataset="d", extra={})
    assert alone["ece_source"] == "in_sample" and not summary(alone)["out_of_sample"]
    validate(alone, "calibration")


def test_previous_release_file_still_reads_and_a_mismatched_list_is_refused(memory_url):
    from dspark_cli import storage
    from dspark_cli.decode.stages import load_calibration
    from dspark_cli.errors import DsparkError

    v1 = {"temperatures": [0.96, 1.04, 1.1], "dataset": "runs/x/prompts", "num_samples": 120,
          "ece_before": 0.0276, "ece_after": 0.0247, "schema_version": 1, "block_size": 3,
          "drafter": "runs/x/train", "temperature": 1.0,
          "grid": {"t_min": 0.05, "t_max": 10.0, "t_steps": 200, "ece_bins": 15},
          "per_position": [{"position": 1, "temperature": 0.96, "samples": 120, "prefix_acceptance": 0.4,
                            "ece_before": 0.09, "ece_after": 0.08, "brier_before": 0.2, "brier_after": 0.2,
                            "roc_auc_before": 0.7, "roc_auc_after": 0.7}]}
    storage.write_json(memory_url + "/v1.json", v1)
    assert load_calibration(memory_url + "/v1.json", gamma=3) == [0.96, 1.04, 1.1]
    assert summary(v1) == {"ece_before": 0.0276, "ece_after": 0.0247, "out_of_sample": False,
                           "in_sample_after": 0.0247, "fitted": [True, True, True]}
    v2 = calibration_file(fit_sts(_overconfident(n=300, gamma=3)), None, dataset="d", extra={})
    storage.write_json(memory_url + "/bad.json", {**v2, "ece_after": [0.1, 0.2]})
    with pytest.raises(DsparkError, match="ece_after has 2 positions"):
        load_calibration(memory_url + "/bad.json")
    storage.write_json(memory_url + "/number.json", {**v2, "ece_after": 0.1})  # v2 with v1's number
    with pytest.raises(DsparkError, match="ece_after"):
        load_calibration(memory_url + "/number.json")


def test_a_fit_that_does_not_help_held_out_conversations_ships_t1():
    # A calibrated head: any finite-sample fit fits bin noise. The search still finds a T ≠ 1 in
    # sample; across held-out halves it does not help, so T = 1 ships. Out of sample (each fold
    # running the check inside itself) the checked procedure beats the unchecked one; it is not
    # always the raw head, as one fold's halves can still be fooled.
    rec = _overconfident(n=600, gamma=4, power=1.0, seed=3, q_range=(0.05, 0.6))
    unchecked = fit_sts(rec, t_min=0.05, t_max=10.0, t_steps=120, held_out_check=False)
    assert unchecked.status[0] == FITTED and unchecked.temperatures[0] != 1.0
    fit = fit_sts(rec, t_min=0.05, t_max=10.0, t_steps=120)
    assert fit.temperatures == [1.0] * 4 and fit.status[0] == NO_GAIN and not any(fit.fitted)
    cross = cross_fit(rec, t_min=0.05, t_max=10.0, t_steps=120)
    unchecked_cross = cross_fit(rec, t_min=0.05, t_max=10.0, t_steps=120, held_out_check=False)
    assert cross.pooled_after < unchecked_cross.pooled_after
    # The file leads with what ships: T = 1 everywhere is the raw head, so its ECE is the raw one;
    # the procedure's cross-fitted figure (a fold did fit) is kept beside it.
    assert any(t != 1.0 for temps in cross.fold_temperatures for t in temps)
    obj = calibration_file(fit, cross, dataset="d", extra={})
    assert obj["ece_after"] == obj["ece_before"] and obj["pooled_ece_after"] == obj["pooled_ece_before"]
    assert obj["cross_fit"]["procedure_pooled_ece_after"] == cross.pooled_after != cross.pooled_before
    # An overconfident head keeps its fit: the check costs nothing where STS helps.
    strong = fit_sts(_overconfident(), t_min=0.1, t_max=10.0, t_steps=120)
    assert strong.status[0] == FITTED and strong.temperatures[0] > 2.0


def _two_populations(n: int = 3000, gamma: int = 4, powers: tuple[float, float] = (2.0, 1.3),
                     per_conversation: int = 10) -> RoundRecords:
    """Even conversations overconfident by powers[0], odd ones by powers[1]: the folds differ."""
    rng = np.random.default_rng(0)
    q = rng.uniform(0.2, 0.97, (n, gamma))
    accepted_slot = rng.random((n, gamma)) < q
    accepted = np.argmin(np.concatenate([accepted_slot, np.zeros((n, 1), bool)], 1), axis=1)
    conversation = np.arange(n) // per_conversation
    power = np.where(conversation % 2 == 0, *powers)[:, None]
    raw = 1.0 / (1.0 + np.exp(-power * np.log(q / (1.0 - q))))
    groups = np.array([f"c{c}" for c in conversation], dtype=object)
    return RoundRecords(raw, np.full(n, gamma), accepted, groups)


def test_a_fit_that_helps_one_fold_and_hurts_the_other_ships_t1():
    # Pooled over both folds the halves' fits help (A's gain outweighs B's loss), but A's
    # temperatures make B worse than its raw head: that is not a gain new data can count on.
    rec = _two_populations()
    halves = cross_fit(rec, t_min=0.05, t_max=10.0, t_steps=120, held_out_check=False)
    assert halves.pooled_after < halves.pooled_before
    assert halves.fold_pooled_after[0] > halves.fold_pooled_before[0]  # B, scored with A's fit
    assert halves.fold_pooled_after[1] < halves.fold_pooled_before[1]
    assert not halves.helps_both_ways
    fit = fit_sts(rec, t_min=0.05, t_max=10.0, t_steps=120)
    assert fit.temperatures == [1.0] * 4 and fit.status[0] == NO_GAIN
    # The file keeps each direction's figures, so a reader sees which one failed.
    obj = calibration_file(fit, halves, dataset="d", extra={})
    assert obj["cross_fit"]["fold_pooled_ece_after"] == halves.fold_pooled_after
    assert obj["cross_fit"]["fold_pooled_ece_before"] == halves.fold_pooled_before
