"""The losslessness audit: retrospective Algorithm 1 fails on Appendix A, causal policies pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dspark_cli.decode.audit import appendix_a_world, audit, batched_world, expected_distribution

SAMPLES = 3000


def test_appendix_a_retrospective_is_biased_to_085():
    r = audit(appendix_a_world(), "retrospective", SAMPLES, positions=1, seed=3)
    assert r.p_value < 1e-10 and not r.passed and r.as_expected
    assert r.first_token_observed[0] == pytest.approx(0.85, abs=0.025)  # paper: (0.7, 0.3) → (0.85, 0.15)


@pytest.mark.parametrize("policy", ["fixed", "threshold", "algorithm1", "async"])
def test_causal_policies_keep_the_target_distribution(policy):
    for world in (appendix_a_world(), batched_world(0)):
        r = audit(world, policy, SAMPLES, positions=2, seed=11)
        assert r.passed, (world.name, policy, r.p_value)
        assert r.first_token_observed[0] == pytest.approx(r.first_token_target[0], abs=0.04)


def test_expected_distribution_sums_to_one():
    probs = expected_distribution(batched_world(0), 2)
    assert len(probs) == 9 and sum(probs.values()) == pytest.approx(1.0)


def test_audit_cli_reports_and_writes_json(tmp_path):
    out = tmp_path / "audit.json"
    proc = subprocess.run([sys.executable, "-m", "dspark_cli.cli", "eval", "audit", "--samples", "600",
                           "--output", str(out)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    by = {(r["world"], r["policy"]): r for r in results}
    assert not by[("appendix_a", "retrospective")]["passed"]
    assert all(r["passed"] for k, r in by.items() if k[1] != "retrospective")
    assert "retrospective" in proc.stdout
