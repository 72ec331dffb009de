"""A pipeline TOML works from any working directory: its inputs resolve against its own folder,
bundled sets through `package://`, while the work dir and outputs follow the working directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dspark_cli
from dspark_cli import manifest
from dspark_cli.config import load_config
from dspark_cli.errors import ConfigError, StageConflictError
from dspark_cli.pipeline import resolved_paths, stage_output

BUNDLED = Path(dspark_cli.__file__).resolve().parent / "resources"


def _config(folder: Path) -> Path:
    (folder / "sets").mkdir(parents=True)
    (folder / "model").mkdir()
    for name in ("prompts.jsonl", "sets/eval.jsonl", "held.jsonl"):
        (folder / name).write_text('{"turns": ["Hi"]}\n')
    path = folder / "p.toml"
    path.write_text("""
[pipeline]
work_dir = "runs/w"
[target]
model = "model"
[data]
source = "prompts.jsonl"
[calibrate]
dataset = "held.jsonl"
[eval]
datasets = ["sets/eval.jsonl", "package://dspark_cli/resources/demo_eval_gsm8k.jsonl"]
sps = "../elsewhere/sps.json"
""")
    return path


def test_inputs_resolve_against_the_config_folder_outputs_against_the_cwd(tmp_path, monkeypatch):
    config = _config(tmp_path / "configs")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.chdir(run_dir)
    for spelled in (str(config), os.path.relpath(config, run_dir)):  # absolute or relative: the same
        cfg = load_config(spelled)
        folder = str(tmp_path / "configs")
        assert cfg.target.model == f"{folder}/model"
        assert cfg.data.source == f"{folder}/prompts.jsonl"
        assert cfg.calibrate.dataset == f"{folder}/held.jsonl"
        assert cfg.eval.datasets == [f"{folder}/sets/eval.jsonl", str(BUNDLED / "demo_eval_gsm8k.jsonl")]
        assert cfg.eval.sps == str(tmp_path / "elsewhere" / "sps.json")
        assert cfg.pipeline.work_dir == "runs/w"  # outputs belong to the run
        assert Path(stage_output(cfg, "cache")).resolve() == run_dir / "runs" / "w" / "cache"


def test_flags_and_set_stay_relative_to_the_cwd_and_hub_ids_stay_ids(tmp_path, monkeypatch):
    config = _config(tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(config, ["data.source=mine.jsonl", "target.model=Qwen/Qwen3-4B",
                               "eval.datasets=['package://dspark_cli/resources/demo_eval_humaneval.jsonl']"],
                      extra={"calibrate": {"dataset": "typed.jsonl"}})
    assert cfg.data.source == "mine.jsonl" and cfg.calibrate.dataset == "typed.jsonl"
    assert cfg.target.model == "Qwen/Qwen3-4B"
    assert cfg.eval.datasets == [str(BUNDLED / "demo_eval_humaneval.jsonl")]
    # In a file, a hub id that names no folder next to it stays an id; so does a hub dataset.
    hub = tmp_path / "configs" / "hub.toml"
    hub.write_text('[target]\nmodel = "Qwen/Qwen3-4B"\n[data]\nsource = "mlabonne/open-perfectblend"\n')
    cfg = load_config(hub)
    assert (cfg.target.model, cfg.data.source) == ("Qwen/Qwen3-4B", "mlabonne/open-perfectblend")


def test_a_missing_package_file_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"package://dspark_cli/resources/nope.jsonl: .*ships no"):
        load_config(None, ["data.source=package://dspark_cli/resources/nope.jsonl"])
    with pytest.raises(ConfigError, match="no installed Python package 'no_such_pkg'"):
        load_config(None, ["eval.datasets=['package://no_such_pkg/x.jsonl']"])
    bad = tmp_path / "bad.toml"
    bad.write_text('[eval]\ndatasets = ["package://dspark_cli"]\n')
    with pytest.raises(ConfigError, match=rf"{bad}: package://dspark_cli: expected package://PACKAGE/PATH"):
        load_config(bad)


def test_the_shipped_smollm2_configs_resolve_from_another_directory(tmp_path, monkeypatch):
    repo = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(tmp_path)
    for path in sorted((repo / "pipelines").glob("*.toml")):  # every shipped config's eval sets
        assert all(Path(d).is_file() for d in load_config(path).eval.datasets), path.name
    for path in sorted((repo / "pipelines").glob("smollm2-*.toml")):
        cfg = load_config(path)
        assert cfg.data.source == str(BUNDLED / "demo_prompts.jsonl")
        assert all(Path(d).is_file() and Path(d).parent == BUNDLED for d in cfg.eval.datasets)
        assert cfg.target.model == str(repo / "runs" / "models" / "smollm2-135m-instruct")
        rows = dict(resolved_paths(cfg))
        assert rows["data.source"] == str(BUNDLED / "demo_prompts.jsonl")
        assert rows["eval output"] == str(tmp_path / cfg.pipeline.work_dir / "eval")


def test_pipeline_show_prints_every_resolved_path(tmp_path):
    config = _config(tmp_path / "configs")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.run([sys.executable, "-m", "dspark_cli.cli", "pipeline", "show", str(config)],
                          cwd=run_dir, capture_output=True, text=True, env=dict(os.environ, COLUMNS="200"))
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    folder = tmp_path / "configs"
    assert shown["data"]["source"] == str(folder / "prompts.jsonl")
    lines = {line.split()[0]: line.split()[-1] for line in proc.stderr.splitlines()[1:] if line.strip()}
    assert lines["target.model"] == str(folder / "model")
    assert lines["eval.datasets[1]"] == str(BUNDLED / "demo_eval_gsm8k.jsonl")
    assert lines["pipeline.work_dir"] == str(run_dir / "runs" / "w")
    assert lines["train"] == str(run_dir / "runs" / "w" / "train")  # "train output  PATH"


def test_a_config_path_spelled_anew_for_the_same_file_is_not_a_conflict(tmp_path, monkeypatch):
    """Outputs made when the config named `dspark_cli/resources/x.jsonl` from the repository stay
    done when it resolves the same file to an absolute path; another file is still refused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text("{}\n")
    (tmp_path / "data" / "b.jsonl").write_text("{}\n")
    out = str(tmp_path / "out")
    manifest.prepare_stage("demo", out, {"data": {"source": "data/a.jsonl", "sets": ["data/a.jsonl"]}},
                           {}).finish({})
    same = {"data": {"source": str(tmp_path / "data" / "a.jsonl"), "sets": [str(tmp_path / "data/a.jsonl")]}}
    assert manifest.prepare_stage("demo", out, same, {}).state == "done"
    with pytest.raises(StageConflictError, match="config key data.source"):
        manifest.prepare_stage("demo", out, {"data": {"source": "data/b.jsonl", "sets": ["data/a.jsonl"]}},
                               {})
    with pytest.raises(StageConflictError, match="config key data.sets"):
        manifest.prepare_stage("demo", out, {"data": {"source": "data/a.jsonl", "sets": ["data/b.jsonl"]}},
                               {})
