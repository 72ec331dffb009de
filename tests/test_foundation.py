"""Storage, manifests, config and the CLI's error contract: the layers every stage stands on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dspark_cli import manifest, storage
from dspark_cli.config import load_config
from dspark_cli.errors import ConfigError, StageConflictError
from dspark_cli.schemas import SCHEMA_DIR, load_schema


@pytest.fixture(params=["local", "memory", "s3"])
def root_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "root")
    if request.param == "memory":
        return request.getfixturevalue("memory_url")
    return request.getfixturevalue("s3_bucket") + "/root"


def test_atomic_write_and_commit_marker(root_url):
    url = storage.join(root_url, "a", "b.json")
    storage.write_json(url, {"x": 1})
    assert storage.read_json(url) == {"x": 1}
    assert not storage.is_committed(storage.join(root_url, "a"))
    storage.commit(storage.join(root_url, "a"))
    assert storage.is_committed(storage.join(root_url, "a"))
    assert storage.listdir(storage.join(root_url, "a")) == ["_COMMITTED", "b.json"]


def test_failed_local_write_leaves_nothing(tmp_path):
    url = str(tmp_path / "out.bin")
    with pytest.raises(RuntimeError), storage.atomic_open(url) as f:
        f.write(b"half")
        raise RuntimeError("killed")
    assert not storage.exists(url)
    assert list(tmp_path.iterdir()) == []


def test_stage_lifecycle_fresh_done_conflict_force(root_url):
    out = storage.join(root_url, "stage")
    run = manifest.prepare_stage("demo", out, {"a": 1}, {"in": "id:x"})
    assert run.state == "fresh"
    assert manifest.prepare_stage("demo", out, {"a": 2}, {"in": "id:x"}).state == "fresh"  # nothing claimed
    run.claim()
    again = manifest.prepare_stage("demo", out, {"a": 1}, {"in": "id:x"})
    assert again.state == "resume"
    again.finish({"rows": 3})
    assert manifest.prepare_stage("demo", out, {"a": 1}, {"in": "id:x"}).state == "done"
    with pytest.raises(StageConflictError, match=r"config key a") as changed:
        manifest.prepare_stage("demo", out, {"a": 2}, {"in": "id:x"})
    assert changed.value.config_keys == ("a",)  # what a caller's hint can name
    with pytest.raises(StageConflictError, match=r"input in") as moved:
        manifest.prepare_stage("demo", out, {"a": 1}, {"in": "id:y"})
    assert moved.value.config_keys == ()
    forced = manifest.prepare_stage("demo", out, {"a": 2}, {"in": "id:x"}, force=True)
    assert forced.state == "fresh" and manifest.read_manifest(out) is not None  # removed only when claimed
    forced.claim()
    assert manifest.read_manifest(out) is None
    forced.abandon()  # produced nothing usable: the next run starts afresh whatever its config
    assert manifest.prepare_stage("demo", out, {"a": 3}, {"in": "id:z"}).state == "fresh"


def test_the_same_local_input_spelled_differently_is_not_a_conflict(tmp_path, monkeypatch):
    """`runs/x` from the repo root and `/abs/.../runs/x` name one input: a rerun with the other
    spelling (a script passing absolute paths after `make demo` passed relative ones) is done."""
    monkeypatch.chdir(tmp_path)
    out = str(tmp_path / "out")
    run = manifest.prepare_stage("demo", out, {"a": 1}, {"runs/in": "id:x"})
    run.finish({"n": 1})
    for spelling in (str(tmp_path / "runs" / "in"), "./runs/in", f"file://{tmp_path}/runs/in"):
        assert manifest.prepare_stage("demo", out, {"a": 1}, {spelling: "id:x"}).state == "done"
    with pytest.raises(StageConflictError):
        manifest.prepare_stage("demo", out, {"a": 1}, {str(tmp_path / "runs" / "in"): "id:y"})


def test_fingerprint_changes_with_content(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("a\n")
    first = manifest.fingerprint(str(f))
    f.write_text("b\n")
    assert manifest.fingerprint(str(f)) != first


def test_every_pipeline_config_loads():
    from pathlib import Path

    files = sorted(Path(__file__).resolve().parents[1].glob("pipelines/*.toml"))
    assert len(files) >= 6
    for path in files:
        cfg = load_config(path)
        assert cfg.pipeline.work_dir


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.lrr'"):
        load_config(None, ["train.lrr=1"])
    with pytest.raises(ConfigError, match=r"train\.num_anchors must be an integer"):
        load_config(None, ["train.num_anchors=many"])
    with pytest.raises(ConfigError, match=r"model\.markov_head_type must be"):
        load_config(None, ["model.markov_head_type=lstm"])
    assert load_config(None, ["target.layers=[2,4]"]).target.layers == [2, 4]


def test_schemas_are_valid_json_schema():
    import jsonschema

    names = [p.name.removesuffix(".schema.json") for p in SCHEMA_DIR.glob("*.schema.json")]
    assert "stage_manifest" in names
    for name in names:
        jsonschema.Draft202012Validator.check_schema(load_schema(name))


def _dspark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_cli.cli", *args], capture_output=True, text=True)


def test_cli_lists_every_stage():
    proc = _dspark("--help")
    assert proc.returncode == 0
    for group in ("data", "cache", "train", "export", "calibrate", "eval", "profile", "serve", "model",
                  "pipeline"):
        assert group in proc.stdout, group


def test_cli_user_error_is_one_line_without_traceback():
    proc = _dspark("pipeline", "show", "pipelines/qwen3-4b.toml", "--set", "train.lrr=2")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.lrr" in lines[0] and "Traceback" not in proc.stderr
    proc = _dspark("pipeline", "show", "no/such.toml")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: no/such.toml: config file not found."


def test_every_stage_function_returns_one_result_type():
    """Commands and scripts read every stage the same way (state, output, manifest, summary)."""
    import typing

    from dspark_cli.cache.build import build_cache
    from dspark_cli.data.prepare import prepare
    from dspark_cli.data.regen import regen
    from dspark_cli.decode.stages import run_calibrate, run_eval, run_profile
    from dspark_cli.stage import StageResult
    from dspark_cli.train.trainer import train

    for stage in (prepare, regen, build_cache, train, run_calibrate, run_eval, run_profile):
        assert typing.get_type_hints(stage)["return"] is StageResult, stage.__qualname__
