"""Ctrl-C (SIGINT) prints the resume line and exits 130, for every stage (issue 29: regen, cache build
and train exited 130 silently, because typer turns KeyboardInterrupt into a returned 130)."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from fixtures.cli import REPO, dspark_script
from fixtures.openai_server import start_openai_server

from dspark_cli.cli import main
from dspark_cli.config import load_config
from dspark_cli.data.prepare import prepare

RESUME_LINE = "interrupted; rerun the same command to resume."


def test_sigint_during_regen_prints_the_resume_line(tmp_path):
    """The real signal through the installed script, mid-run against a slow server."""
    import os

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
                           for i in range(20)))
    prompts = str(tmp_path / "prompts")
    prepare(load_config(None, [f"data.source={src}"]), prompts)
    with start_openai_server(model="m", faults={"delay": 5.0}) as server:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("DSPARK_DEBUG", None)
        proc = subprocess.Popen([dspark_script(), "data", "regen", "-i", prompts, "-o", str(tmp_path / "r"),
                                 "--endpoint", server.url, "--model", "m", "--concurrency", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.time() + 60
        while not (tmp_path / "r" / "_run.json").exists() and time.time() < deadline:
            time.sleep(0.1)  # the output is claimed once the probe passed: requests are in flight
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert RESUME_LINE in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,module,name", [
    (["cache", "build", "--responses", "r", "-o", "c", "--target", "t"], "dspark_cli.cache.build",
     "build_cache"),
    (["train", "--cache", "c", "-o", "t"], "dspark_cli.train.trainer", "train"),
    (["data", "prepare", "--source", "a.jsonl", "-o", "p"], "dspark_cli.data.prepare", "prepare"),
])
def test_every_stage_says_how_to_resume(monkeypatch, tmp_path, capsys, argv, module, name):
    import importlib

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
    monkeypatch.setattr(importlib.import_module(module), name, interrupted)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 130
    assert RESUME_LINE in capsys.readouterr().err
