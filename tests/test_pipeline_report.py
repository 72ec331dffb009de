"""`dspark pipeline report` on a pipeline that has not got far: what finished, and what not.

The full report (τ, acceptance, ECE, speed-up, plots) is checked against a real pipeline run's
artifacts in test_pipeline_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dspark_cli import manifest


def _dspark(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_cli.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, COLUMNS="200"))


def test_report_of_a_pipeline_that_only_prepared(tmp_path):
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"turns": [f"Question {i}?"]}) + "\n"
                                                  for i in range(5)))
    config = tmp_path / "p.toml"
    config.write_text('[pipeline]\ntitle = "tiny"\nwork_dir = "work"\n[data]\nsource = "chats.jsonl"\n')

    nothing = _dspark(tmp_path, "pipeline", "report", str(config))
    assert nothing.returncode == 2 and "Traceback" not in nothing.stderr
    assert nothing.stderr.splitlines()[0] == (f"error: {config}: no stage has finished under work.")

    assert _dspark(tmp_path, "pipeline", "run", str(config), "--stages", "prepare").returncode == 0
    shown = _dspark(tmp_path, "pipeline", "report", str(config), "--json")
    assert shown.returncode == 0, shown.stderr
    figures = json.loads(shown.stdout)
    stages = {s["stage"]: s for s in figures["stages"]}
    prepared = manifest.read_manifest(str(tmp_path / "work" / "prompts"))
    assert stages["prepare"]["seconds"] == prepared["timings"]["wall_seconds"]
    assert [s for s, row in stages.items() if not row["finished"]] == ["regen", "cache", "train",
                                                                        "calibrate", "eval"]
    assert figures["eval"] is None and figures["calibration"] is None and figures["plots"] == []
    text = _dspark(tmp_path, "pipeline", "report", str(config)).stdout
    assert "not finished" in text and "eval: not finished" in text and "calibrate: not finished" in text
