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
from dspark_cli.decode.calibrate import summary as calibration_summary

STAGE_DIRS = ("prompts", "responses", "cache", "train", "calibration", "eval")
QUESTIONS = ["What is 12 plus 30?", "Write a poem about the sea.", "Explain def add(a, b).",
             "Hello! How can I help?", "Explain speculative decoding.", "Natalia sold clips in April."]


def _write_pipeline(tmp: Path, target: Path) -> Path:
    """The config and its input files in one folder, named relative to it (the target too); the
    pipeline then runs from another directory, where its work dir lands."""
    folder = tmp / "config"
    folder.mkdir()
    with open(folder / "prompts.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"turns": [f"{QUESTIONS[i % 6]} Case {i}."]}) + "\n")
    with open(folder / "eval.jsonl", "w") as f:
        for q in QUESTIONS[:2]:
            f.write(json.dumps({"turns": [q + " Eval."]}) + "\n")
    config = folder / "tiny.toml"
    config.write_text(f"""
[pipeline]
work_dir = "work"

[target]
model = "{os.path.relpath(target, folder)}"
dtype = "float32"
layers = "auto"  # the cache resolves [1, 9, 17, 25, 33]; train and eval take them from it
mask_token_id = {mask_token_id(target)}

[data]
source = "prompts.jsonl"
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
max_steps = 40   # long enough that the kill below lands inside training (4 steps could finish first)
save_every = 5

[calibrate]
num_prompts = 2
max_new_tokens = 12

[eval]
datasets = ["eval.jsonl", "package://dspark_cli/resources/demo_eval_gsm8k.jsonl"]
limit = 2
max_new_tokens = 12
""")
    return config


def _start(config: Path, cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "dspark_cli.cli", "pipeline", "run", str(config)],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


@pytest.mark.timeout(900)
def test_pipeline_killed_midway_then_resumed_completes(tmp_path, tiny_qwen3_target):
    config = _write_pipeline(tmp_path, tiny_qwen3_target)
    run_dir = tmp_path / "run"  # not the config's folder: inputs resolve there, outputs here
    run_dir.mkdir()
    work = run_dir / "work"

    proc = _start(config, run_dir)
    deadline = time.time() + 600
    while not (work / "train" / "_run.json").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "training never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert manifest.read_manifest(str(work / "train")) is None  # killed before train finished

    proc = _start(config, run_dir)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    assert "data prepare: " in output and "nothing to do" in output  # finished stages are skipped
    # train.precision auto, resolved once up front (the suite pins DSPARK_CPU_BF16=0)
    assert "target dtype float32, train precision fp32 (this CPU has no native bf16" in " ".join(
        output.split()), output

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
    assert [d["name"] for d in report["datasets"]] == ["eval", "demo_eval_gsm8k"]  # + the bundled set
    for dataset in report["datasets"]:
        assert dataset["new_tokens"] > 0 and 1.0 <= dataset["tau"] <= 4 + 1
        assert dataset["conversations"] == 2
        low, high = dataset["tau_interval"]  # 95% over its conversations
        assert low <= dataset["tau"] <= high
    assert report["calibration"]  # the pipeline hands calibrate's file to eval

    rerun = _start(config, run_dir)
    output, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, output
    assert output.count("nothing to do") == len(STAGE_DIRS), output

    _check_report(config, run_dir, work, report, calibration)


def _check_report(config: Path, run_dir: Path, work: Path, report: dict, calibration: dict) -> None:
    """`dspark pipeline report` gives back what the stages committed, figure for figure."""
    proc = _report(config, run_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout)
    seconds = {s["stage"]: s["seconds"] for s in figures["stages"]}
    for stage, stage_dir in zip(("prepare", "regen", "cache", "train", "calibrate", "eval"), STAGE_DIRS,
                                strict=True):
        assert seconds[stage] == manifest.read_manifest(str(work / stage_dir))["timings"]["wall_seconds"]
    shown = [(d["name"], d["tau"], d["speedup"], d["break_even_tau"]) for d in figures["eval"]["datasets"]]
    assert shown == [(d["name"], d["tau"], d["tokens_per_second"]["speedup"],
                      d["round_cost"]["cost_in_target_steps"]) for d in report["datasets"]]
    assert figures["eval"]["datasets"][0]["conditional"] == \
        report["datasets"][0]["position_acceptance"]["conditional"]
    pooled = calibration_summary(calibration)  # v2 files hold per-position lists; the report the pooled ECE
    assert (figures["calibration"]["ece_before"], figures["calibration"]["ece_after"]) == (
        pooled["ece_before"], pooled["ece_after"])
    # Outputs are named as the config does (work_dir "work"), relative to the directory it ran in.
    assert sorted(figures["plots"]) == ["work/calibration/reliability.png", "work/eval/acceptance.png",
                                        "work/eval/threshold_sweep.png"]
    assert all((run_dir / plot).is_file() for plot in figures["plots"])

    proc = _report(config, run_dir)
    text = proc.stdout
    assert proc.returncode == 0, proc.stderr
    first = report["datasets"][0]
    assert f"{first['tau']:.2f}" in text and "speed-up" in text and "break-even" in text
    assert f"{first['round_cost']['cost_in_target_steps']:.2f}" in text
    assert f"{pooled['ece_before']:.2%} → {pooled['ece_after']:.2%}" in text
    assert "plot: work/eval/acceptance.png" in text
    assert "τ {:.2f}–{:.2f} (95% over 2".format(*first["tau_interval"]) in text

    # The outputs belong to the directory the pipeline ran in: from the config's folder there are none.
    proc = _report(config, config.parent)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ")
    assert "no stage has finished" in proc.stderr and "Traceback" not in proc.stderr


def _report(config: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_cli.cli", "pipeline", "report", str(config), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLUMNS="200"))
