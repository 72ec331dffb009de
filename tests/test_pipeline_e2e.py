"""`dspark pipeline run` end to end on the tiny fixture target: every stage, killed mid-way, resumed.

The pipeline runs as a real process tree (pipeline → one `dspark` process per stage, plus
`dspark serve` for regen), so SIGKILL goes to the whole process group, as a crash or a
preempted job would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.tiny_models import mask_token_id

from dspark_cli import manifest
from dspark_cli.data.io import read_rows

STAGE_DIRS = ("prompts", "responses", "cache", "train", "calibration", "eval")
QUESTIONS = ["What is 12 plus 30?", "Write a poem about the sea.", "Explain def add(a, b).",
             "Hello! How can I help?", "Explain speculative decoding.", "Natalia sold clips in April."]


def _write_pipeline(tmp: Path, target: Path) -> Path:
    with open(tmp / "prompts.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"turns": [f"{QUESTIONS[i % 6]} Case {i}."]}) + "\n")
    with open(tmp / "eval.jsonl", "w") as f:
        for q in QUESTIONS[:2]:
            f.write(json.dumps({"turns": [q + " Eval."]}) + "\n")
    config = tmp / "tiny.toml"
    config.write_text(f"""
[pipeline]
work_dir = "{tmp / 'work'}"

[target]
model = "{target}"
dtype = "float32"
layers = "auto"  # the cache resolves [1, 9, 17, 25, 33]; train and eval take them from it
mask_token_id = {mask_token_id(target)}

[data]
source = "{tmp / 'prompts.jsonl'}"
val_fraction = 0.25

[regen]
serve_target = true
model = "tiny"
max_tokens = 16
temperature = 1.0
keep_truncated = true   # a random target rarely says end-of-turn within 16 tokens

[cache]
max_length = 96
min_loss_tokens = 4

[model]
num_draft_layers = 1
block_size = 4
markov_rank = 16

[train]
num_anchors = 8
global_batch = 2
max_steps = 4
save_every = 2

[calibrate]
num_prompts = 2
max_new_tokens = 12

[eval]
datasets = ["{tmp / 'eval.jsonl'}"]
max_new_tokens = 12
""")
    return config


def _start(config: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "dspark_cli.cli", "pipeline", "run", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


@pytest.mark.timeout(900)
def test_pipeline_killed_midway_then_resumed_completes(tmp_path, tiny_qwen3_target):
    config = _write_pipeline(tmp_path, tiny_qwen3_target)
    work = tmp_path / "work"

    proc = _start(config)
    deadline = time.time() + 600
    while not (work / "train" / "_run.json").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "training never started"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert manifest.read_manifest(str(work / "train")) is None  # killed before train finished

    proc = _start(config)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    assert "data prepare: " in output and "nothing to do" in output  # finished stages are skipped

    for stage_dir in STAGE_DIRS:
        assert manifest.read_manifest(str(work / stage_dir)) is not None, stage_dir
    prompts = {r["id"] for r in read_rows(str(work / "prompts"))}
    responses = [r["id"] for r in read_rows(str(work / "responses"))]
    assert sorted(responses) == sorted(prompts)  # every prompt exactly once
    export = json.loads((work / "train" / "export" / "config.json").read_text())
    # layers = "auto": resolved once by cache build, recorded, then taken by train (and eval)
    assert manifest.read_manifest(str(work / "cache"))["extra"]["layers"] == [1, 9, 17, 25, 33]
    assert export["target_layer_ids"] == [1, 9, 17, 25, 33]
    calibration = json.loads((work / "calibration" / "calibration.json").read_text())
    assert len(calibration["temperatures"]) == 4
    report = json.loads((work / "eval" / "report.json").read_text())
    (dataset,) = report["datasets"]
    assert dataset["new_tokens"] > 0 and 1.0 <= dataset["tau"] <= 4 + 1
    assert report["calibration"]  # the pipeline hands calibrate's file to eval

    rerun = _start(config)
    output, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, output
    assert output.count("nothing to do") == len(STAGE_DIRS), output
