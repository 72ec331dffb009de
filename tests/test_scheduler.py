"""Algorithm 1 on hand-computed cases (incl. the early stop), top-K, threshold, async, SPS tables."""

from __future__ import annotations

import pytest

from dspark_cli.decode.scheduler import (
    Scheduler,
    algorithm1,
    expected_throughput,
    prefix_survival,
    threshold_lengths,
    top_k_lengths,
)
from dspark_cli.decode.sps import SpsTable
from dspark_cli.errors import DsparkError


def test_sps_interpolates_and_is_flat_outside():
    sps = SpsTable([4, 1, 2], [50.0, 100.0, 90.0])
    assert sps.batch_tokens == [1, 2, 4]
    assert sps(1) == 100.0 and sps(0) == 100.0 and sps(100) == 50.0
    assert sps(3) == pytest.approx(70.0)
    with pytest.raises(DsparkError):
        SpsTable([1, 1], [1.0, 2.0])
    with pytest.raises(DsparkError):
        SpsTable([1], [0.0])


def test_sps_round_trip_through_schema(tmp_path):
    sps = SpsTable([1, 8], [10.0, 5.0], {"device": "cpu"})
    sps.save(str(tmp_path / "sps.json"))
    assert SpsTable.load(str(tmp_path / "sps.json")).to_dict() == sps.to_dict()
    (tmp_path / "bad.json").write_text('{"schema_version": 1, "batch_tokens": [1], "steps_per_second": [-1]}')
    with pytest.raises(DsparkError, match="steps_per_second"):
        SpsTable.load(str(tmp_path / "bad.json"))


def test_sps_file_is_sglangs_cost_table_and_the_first_release_form_still_reads(tmp_path):
    """SGLang's SpsCostTable: sample_batch_tokens / sample_steps_per_sec / max_batch_tokens (DESIGN.md §3)."""
    import json

    SpsTable([4, 1, 2], [50.0, 100.0, 90.0], {"device": "cpu"}).save(str(tmp_path / "sps.json"))
    obj = json.loads((tmp_path / "sps.json").read_text())
    assert obj["sample_batch_tokens"] == [1, 2, 4] and obj["sample_steps_per_sec"] == [100.0, 90.0, 50.0]
    assert obj["max_batch_tokens"] == 4 and isinstance(obj["max_batch_tokens"], int)
    assert "batch_tokens" not in obj and "steps_per_second" not in obj
    (tmp_path / "v1.json").write_text(json.dumps({"schema_version": 1, "batch_tokens": [1, 8],
                                                  "steps_per_second": [10.0, 5.0], "meta": {}}))
    old = SpsTable.load(str(tmp_path / "v1.json"))
    assert old.batch_tokens == [1, 8] and old(4.5) == pytest.approx(7.5) and old.max_batch_tokens == 8
    # A table SGLang's own profiler wrote (no schema_version, no meta) reads too.
    (tmp_path / "sg.json").write_text(json.dumps({"sample_batch_tokens": [1, 64], "sample_steps_per_sec":
                                                  [30.0, 20.0], "max_batch_tokens": 512}))
    assert SpsTable.load(str(tmp_path / "sg.json")).max_batch_tokens == 512
    bad = {"sample_batch_tokens": [1], "sample_steps_per_sec": [1.0]}
    (tmp_path / "bad2.json").write_text(json.dumps(bad))
    with pytest.raises(DsparkError, match="sps_table"):
        SpsTable.load(str(tmp_path / "bad2.json"))


def test_prefix_survival_and_expected_throughput():
    assert prefix_survival([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]
    sps = SpsTable([1, 2, 3, 4], [1.0, 0.9, 0.8, 0.7])
    tau, batch, theta = expected_throughput([[0.5, 0.5], [0.9, 0.1]], [2, 1], sps)
    assert (tau, batch) == (pytest.approx(1 + 0.5 + 0.25 + 1 + 0.9), 5)
    assert theta == pytest.approx(tau * 0.7)


def test_algorithm1_hand_computed_two_requests():
    # a: r0 = [0.9, 0.72], r1 = [0.5, 0.05]; order (0,0) .9, (0,1) .72, (1,0) .5, (1,1) .05
    sps = SpsTable([2, 3, 4, 5, 6], [10.0, 9.5, 8.0, 7.0, 6.5])
    conf = [[0.9, 0.8], [0.5, 0.1]]
    # Θ: B=2 τ=2 → 20; +0.9 → 2.9·9.5=27.55; +0.72 → 3.62·8=28.96; +0.5 → 4.12·7=28.84 stop.
    assert algorithm1(conf, sps) == [2, 0]


def test_algorithm1_early_stop_differs_from_retrospective_search():
    """The first admission lowers Θ, a later one would raise it: causal stops, retrospective looks on."""
    sps = SpsTable([1, 2, 3], [1.0, 0.6, 0.59])
    conf = [[0.6, 0.9]]  # Θ: 1 → 1.6·0.6 = 0.96 (stop) → 2.14·0.59 = 1.26
    assert algorithm1(conf, sps) == [0]
    assert algorithm1(conf, sps, early_stop=False) == [2]
    assert algorithm1([[0.6, 0.1]], sps, early_stop=False) == [0]  # x_1's own confidence decides: biased


def test_algorithm1_respects_max_len_and_constant_sps_admits_all():
    assert algorithm1([[0.9, 0.9, 0.9]], SpsTable.constant(), max_len=[2]) == [2]
    assert algorithm1([[0.9, 0.9], [0.1, 0.9]], SpsTable.constant()) == [2, 2]


def test_top_k_and_threshold():
    conf = [[0.9, 0.5, 0.9], [0.8, 0.9, 0.2]]  # a: [.9, .45, .405], [.8, .72, .144]
    assert top_k_lengths(conf, 3) == [1, 2]
    assert top_k_lengths(conf, 0) == [0, 0]
    assert top_k_lengths(conf, 99) == [3, 3]
    assert threshold_lengths(conf, 0.44) == [2, 2]
    assert threshold_lengths(conf, 0.44, max_len=[1, 3]) == [1, 2]


def test_async_capacity_comes_from_two_rounds_ago():
    sps = SpsTable([2, 3, 4, 5, 6], [10.0, 9.5, 8.0, 7.0, 6.5])
    sched = Scheduler("async", gamma=2, sps=sps)
    first = [[0.9, 0.8], [0.5, 0.1]]  # Algorithm 1 admits 2 here
    low = [[0.1, 0.1], [0.1, 0.1]]  # Algorithm 1 admits 0 here
    assert sched.schedule(first, [2, 2]) == [2, 2]  # no history yet: everything
    assert sched.schedule(low, [2, 2]) == [2, 2]
    # Round 3 uses round 1's capacity (2), whatever its own confidences say.
    assert sched.schedule(low, [2, 2]) == [1, 1]
    # Round 4 uses round 2's capacity (0).
    assert sched.schedule(first, [2, 2]) == [0, 0]


def test_scheduler_policies_and_errors():
    assert Scheduler("fixed", 4).schedule(None, [9, 2, 0]) == [4, 2, 0]
    with pytest.raises(DsparkError, match="confidence head"):
        Scheduler("algorithm1", 4).schedule(None, [4])
    with pytest.raises(DsparkError, match="unknown schedule"):
        Scheduler("greedy", 4)
    assert Scheduler("threshold", 2, threshold=0.5).schedule([[0.9, 0.5]], [2]) == [1]
