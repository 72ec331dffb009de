"""What the environment hands back (a folder for a file, non-UTF-8 text, a damaged gzip, safetensors or
GGUF file, a path that cannot be created) is one line naming the path, exit 2, never a traceback
(issue 29). The most common faults run through the installed `dspark` script; the rest in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.cli import REPO, assert_user_error, run_dspark
from fixtures.drafter import drafter_config

from dspark_cli.cli import main


def _row(i: int) -> str:
    return json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_qwen3_target) -> Path:
    """One damaged or misplaced input of each kind a command reads."""
    root = tmp_path_factory.mktemp("faults")
    (root / "a_folder").mkdir()
    (root / "latin1.toml").write_bytes(b"[train]\nlr = 3e-4  # caf\xe9\n")
    (root / "notgzip.jsonl.gz").write_bytes(b"plain text, not gzip\n")
    (root / "good.jsonl").write_text("".join(_row(i) for i in range(4)))
    (root / "a_file").write_text("the user's own file\n")
    (root / "fake.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    for name, weights in (("truncated", b"\x40\x00\x00\x00\x00\x00\x00\x00{\"a\":"), ("empty", b"")):
        ckpt = root / name
        ckpt.mkdir()
        config = drafter_config(tiny_qwen3_target, num_draft_layers=1)
        (ckpt / "drafter_config.json").write_text(config.to_json())
        (ckpt / "model.safetensors").write_bytes(weights)
    (root / "no_keys").mkdir()
    (root / "no_keys" / "drafter_config.json").write_text("{}")
    binary = root / "binary_manifest"
    binary.mkdir()
    (binary / "manifest.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    return root


#: (argv, {r} standing for the fixture folder, what the one line must name)
ENTRY_POINT_CASES = [
    (["train", "--config", "{r}/a_folder"], ["a_folder", "is a folder"]),
    (["train", "--config", "{r}/latin1.toml"], ["latin1.toml", "not UTF-8"]),
    (["data", "prepare", "--source", "{r}/notgzip.jsonl.gz", "-o", "{r}/o1"], ["notgzip.jsonl.gz"]),
    (["data", "prepare", "--source", "{r}/good.jsonl", "-o", "{r}/a_file/sub"], ["a_file", "not a dir"]),
    (["data", "prepare", "--source", "{r}/good40.jsnol", "-o", "{r}/o2"], ["good40.jsnol", "not found"]),
    (["export", "{r}/good.jsonl", "{r}/a_file"], ["a_file", "existing file"]),
    (["export", "{r}/truncated", "{r}/e1"], ["truncated/model.safetensors"]),
    (["data", "regen", "-i", "{r}/binary_manifest", "-o", "{r}/r", "--endpoint", "http://127.0.0.1:9/v1",
      "--model", "m"],
     ["binary_manifest/manifest.json", "not UTF-8", "so it is damaged"]),
    (["model", "convert", "{r}/fake.gguf", "{r}/m"], ["fake.gguf", "GGUF"]),
    (["serve", "{r}/a_folder", "--port", "99999"], ["--port"]),
    (["serve", "{r}/a_folder", "--threads", "-1"], ["--threads"]),
    (["profile", "--batch-tokens", "1,x"], ["--batch-tokens"]),
    (["train", "--set", "train.lr=nan"], ["train.lr", "finite"]),
    (["data", "regen", "-i", "{r}/binary_manifest", "-o", "{r}/r", "--model", "m", "--endpoint",
      "http://u:pw@127.0.0.1:9/v1"], ["http://[REDACTED]@127.0.0.1:9/v1", "credentials"]),
]


@pytest.mark.parametrize("argv,culprits", ENTRY_POINT_CASES)
def test_the_installed_script_never_shows_a_traceback(files, argv, culprits):
    proc = run_dspark(*(a.replace("{r}", str(files)) for a in argv), cwd=files)
    assert_user_error(proc, *culprits)
    assert (files / "a_file").read_text() == "the user's own file\n"


def _main(argv: list[str], capsys) -> tuple[int, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.lower().startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv,culprits", [
    (["eval", "--concurrency-sweep", "2,x"], ["--concurrency-sweep", "must be an integer", "'x'"]),
    (["eval", "audit", "--alpha", "nan"], ["--alpha"]),
    (["serve", "{r}/a_folder", "--batch-wait-ms", "inf"], ["--batch-wait-ms", "finite"]),
    (["data", "regen", "-i", "{r}/binary_manifest", "-o", "{r}/r", "--model", "m", "--temperature", "nan"],
     ["--temperature", "regen.temperature must be a finite number"]),
    (["train", "--set", "train.grad_clip=-inf"], ["train.grad_clip", "finite"]),
    (["export", "{r}/empty", "{r}/e2"], ["empty/model.safetensors", "damaged"]),
    (["export", "{r}/good.jsonl", "{r}/good.jsonl"], ["good.jsonl"]),
    (["export", "{r}/no_keys", "{r}/e3"], ["no_keys/drafter_config.json", "damaged"]),
    (["pipeline", "new", "--target", "{r}/a_folder", "-o", "{r}/a_folder"], ["a_folder", "is a folder"]),
    (["data", "prepare", "--source", "{r}/good.jsonl", "-o", "/proc/no/such/place"], ["/proc/no"]),
    (["data", "prepare", "--source", "goood.jsonl", "-o", "{r}/o3"], ["goood.jsonl", "not found"]),
    (["train", "--cache", "{r}/cahce", "-o", "{r}/t", "--set", "target.mask_token_id=3"],
     ["cahce", "no such cache folder"]),
    (["cache", "verify", "{r}/cahce"], ["cahce", "no such cache folder"]),
    (["plan", str(REPO / "pipelines/qwen3-4b.toml"), "--tflops", "inf"], ["--tflops", "finite", "inf"]),
    (["plan", str(REPO / "pipelines/qwen3-4b.toml"), "--tflops", "nan"], ["--tflops", "finite", "nan"]),
])
def test_in_process_faults_are_one_line(files, capsys, monkeypatch, argv, culprits):
    monkeypatch.chdir(files)
    code, err = _main([a.replace("{r}", str(files)) for a in argv], capsys)
    assert code == 2, err
    line = _one_line(err) if "Usage" not in err else err
    for culprit in culprits:
        assert culprit in line, (culprit, line)


def test_export_onto_a_user_folder_is_refused_and_leaves_it_as_it_was(files, capsys):
    """Issue 29's re-run: export wrote its two files among the user's own (a stage refuses that)."""
    mine = files / "users_folder"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine\n")
    code, err = _main(["export", str(files / "truncated"), str(mine)], capsys)
    line = _one_line(err)
    assert code == 2 and "users_folder: folder is not empty (keep.txt)" in line, err
    assert "no drafter export" in line
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt"]


def test_hints_name_the_rerun_or_the_argument_the_command_has(files, capsys):
    """A damaged manifest.json is dspark's own file: rerun its stage (not "save it as UTF-8"); export
    takes CHECKPOINT, so its hint names no --drafter flag."""
    code, err = _main(["data", "regen", "-i", str(files / "binary_manifest"), "-o", str(files / "r2"),
                       "--endpoint", "http://127.0.0.1:9/v1", "--model", "m"], capsys)
    assert code == 2 and f"hint: rerun the stage that wrote {files / 'binary_manifest'}" in err, err
    assert "save the file as UTF-8" not in err
    code, err = _main(["export", str(files / "a_folder"), str(files / "e5")], capsys)
    assert code == 2 and "a_folder: is neither a dspark checkpoint" in _one_line(err), err
    assert "--drafter" not in err and "hint: pass a train artifact, checkpoint or export folder" in err


def test_a_missing_file_beside_its_right_spelling_gets_a_did_you_mean(files, capsys, monkeypatch):
    monkeypatch.chdir(files)
    code, err = _main(["data", "prepare", "--source", "good.jsnol", "-o", str(files / "o4")], capsys)
    assert code == 2 and "not found" in _one_line(err) and "did you mean good.jsonl?" in err
    assert not (files / "o4").exists()


def test_debug_shows_the_traceback(files, monkeypatch):
    monkeypatch.setenv("DSPARK_DEBUG", "1")
    with pytest.raises(NotADirectoryError):
        main(["data", "prepare", "--source", str(files / "good.jsonl"), "-o", str(files / "a_file" / "x")])


def test_a_bom_keeps_the_first_row_and_pipeline_new_makes_its_folder(tmp_path, capsys, tiny_llama_target):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "".join(_row(i) for i in range(5)).encode())
    code, err = _main(["data", "prepare", "--source", str(src), "-o", str(tmp_path / "p"),
                       "--val-fraction", "0"], capsys)
    assert code == 0, err
    counts = json.loads((tmp_path / "p" / "manifest.json").read_text())["counts"]
    assert counts["rows"] == 5 and counts.get("quarantined", 0) == 0, counts
    toml = tmp_path / "new" / "folder" / "my.toml"
    code, err = _main(["pipeline", "new", "--target", str(tiny_llama_target), "-o", str(toml)], capsys)
    assert code == 0 and toml.is_file(), err
    bom_toml = tmp_path / "bom.toml"
    bom_toml.write_bytes(b"\xef\xbb\xbf" + toml.read_bytes())
    from dspark_cli.config import load_config

    assert load_config(str(bom_toml), []).target.model == load_config(str(toml), []).target.model


def test_endpoint_urls_name_what_is_missing_and_never_show_credentials(files, capsys):
    from dspark_cli.redact import redact

    common = ["data", "regen", "-i", str(files / "binary_manifest"), "-o", str(files / "r"), "--model", "m"]
    for endpoint, says in (("localhost:18001/v1", "no http:// or https:// scheme"),
                           ("http://127.0.0.1:x/v1", "is not a URL"),
                           ("http://alice:hunter2pw@127.0.0.1:9/v1", "holds credentials")):
        code, err = _main([*common, "--endpoint", endpoint], capsys)
        line = _one_line(err)
        assert code == 2 and says in line and line.startswith("error: --endpoint: regen.endpoints[0]"), err
        assert "hunter2pw" not in err and "alice" not in err
    assert redact("GET http://bob:s3cret@gpu1:8000/v1 failed") == "GET http://[REDACTED]@gpu1:8000/v1 failed"


def test_a_mask_token_that_is_eos_or_pad_is_refused(tiny_qwen3_target):
    from transformers import AutoConfig

    from dspark_cli.errors import ConfigError
    from dspark_cli.model.config import DrafterConfig

    config = AutoConfig.from_pretrained(tiny_qwen3_target)
    for busy, name in ((config.eos_token_id, "eos"), (config.pad_token_id, "pad")):
        with pytest.raises(ConfigError, match=f"mask_token_id {busy} is the target's {name}"):
            DrafterConfig.from_target(config, layers=[1, 2], mask_token_id=busy)
    spare = DrafterConfig.from_target(config, layers=[1, 2], mask_token_id=config.vocab_size - 1)
    assert spare.mask_token_id == config.vocab_size - 1


def test_pipeline_run_probes_the_regen_endpoint_before_the_first_stage(tmp_path, capsys):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(_row(i) for i in range(4)))
    toml = tmp_path / "p.toml"
    toml.write_text(f'[pipeline]\nwork_dir = "{tmp_path / "work"}"\n[data]\nsource = "{src}"\n'
                    '[regen]\nendpoints = ["http://127.0.0.1:9/v1"]\nmodel = "m"\n')
    code, err = _main(["pipeline", "run", str(toml), "--stages", "prepare,regen"], capsys)
    line = _one_line(err)
    assert code == 2 and "stage regen" in line and "127.0.0.1:9" in line and "connection refused" in line
    assert "regen.endpoints in a config" in err  # pipeline run has no --endpoint flag to fix
    assert not (tmp_path / "work").exists()  # prepare did not run


def test_help_reads_as_words_and_lists_commands_in_pipeline_order(capsys):
    import re

    from dspark_cli.cli import command
    from dspark_cli.commands._help import ORDER

    assert list(command().commands) == list(ORDER)
    for argv in (["data", "regen"], ["cache", "build"], ["train"], ["eval"], ["serve"], ["model", "convert"],
                 ["export", "write"], ["pipeline", "run"], ["profile"], ["calibrate"], ["data", "prepare"]):
        text = _help(argv, capsys)
        assert not re.search(r"<(str|int|float|list\[\w+\])>|\{[a-z_]+\}", text), (argv, text)
    regen = _help(["data", "regen"], capsys)
    assert "--set KEY=VALUE" in regen and "--endpoint URL" in regen and "--concurrency N" in regen
    assert "-o, --output PATH" in regen and "--temperature X" in regen
    assert "SRC" in _help(["model", "convert"], capsys) and "Usage: dspark serve [OPTIONS] {MODEL}" in \
        _help(["serve"], capsys)


def test_repeated_calls_in_one_process_register_each_command_once(capsys):
    """The tree is built once: rebuilding it per call re-registered every command (the suite slowed)."""
    from dspark_cli.cli import app

    _help(["train"], capsys)
    registered = (len(app.registered_commands), len(app.registered_groups))
    _help(["eval"], capsys)
    _help(["data", "regen"], capsys)
    assert (len(app.registered_commands), len(app.registered_groups)) == registered


def _help(argv: list[str], capsys) -> str:
    code = 0
    try:
        main([*argv, "--help"])
    except SystemExit as e:
        code = int(e.code or 0)
    assert code == 0
    return capsys.readouterr().out


def test_the_first_cache_progress_line_says_nothing_about_bytes_not_yet_written():
    from dspark_cli.cache.build import progress_line

    first = progress_line(0, 1, 4, tokens=1000, raw_bytes=0, stored_bytes=0, elapsed=2.0)
    assert first == "  shard     0 (1/4): 500 tok/s, ETA 6s"
    later = progress_line(3, 2, 4, tokens=1000, raw_bytes=4096, stored_bytes=2048, elapsed=2.0)
    assert "2.0 KiB written, compression 2.00×" in later or "written, compression 2.00×" in later


def test_a_failed_shard_write_leaves_no_temporary(tmp_path, monkeypatch):
    import errno

    from dspark_cli import storage
    from dspark_cli.cache import store

    def disk_full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "commit", disk_full)
    with pytest.raises(OSError):
        store.write_shard(str(tmp_path / "shards" / "shard-00000"), {"a/zarr.json": b"{}"}, {})
    assert list((tmp_path / "shards").iterdir()) == []


def test_a_truncated_target_safetensors_is_one_line_naming_the_target(tmp_path, tiny_llama_target):
    import shutil

    from dspark_cli.errors import DsparkError
    from dspark_cli.target.model import load_target

    copy = tmp_path / "target"
    shutil.copytree(tiny_llama_target, copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(DsparkError, match=f"target '{copy}': cannot load it"):
        load_target(str(copy), dtype="float32", device="cpu")
