"""SIGKILL in the middle of `dspark cache build`, rerun: the same arrays, byte for byte."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fixtures.cache_responses import response_rows, write_responses

from dspark_cli import manifest
from dspark_cli.cache.verify import verify_cache


def _build_cmd(responses: str, out: Path, target: Path) -> list[str]:
    return [sys.executable, "-m", "dspark_cli.cli", "cache", "build", "--responses", responses,
            "--output", str(out), "--target", str(target), "--layers", "1,9,17,25,33", "--device", "cpu",
            "--samples-per-shard", "1", "--min-loss-tokens", "8"]


def _committed(out: Path) -> list[str]:
    shards = out / "shards"
    if not shards.exists():
        return []
    return sorted(p.name for p in shards.glob("shard-*") if (p / "_COMMITTED").exists())


def test_sigkill_mid_build_then_rerun_gives_identical_checksums(tiny_qwen3_target, tmp_path):
    responses = write_responses(str(tmp_path / "responses"), response_rows(8))
    env = {**os.environ, "DSPARK_TEST_THREADS": "1", "OMP_NUM_THREADS": "1"}
    clean = tmp_path / "clean"
    subprocess.run(_build_cmd(responses, clean, tiny_qwen3_target), check=True, env=env,
                   capture_output=True, timeout=240)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_build_cmd(responses, killed, tiny_qwen3_target), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 200
    while len(_committed(killed)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = _committed(killed)
    assert 2 <= len(done_before) < 8, done_before  # killed mid-build, not before or after
    assert manifest.read_manifest(str(killed)) is None

    rerun = subprocess.run(_build_cmd(responses, killed, tiny_qwen3_target), env=env, capture_output=True,
                           text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(done_before)} already committed" in " ".join(rerun.stderr.split())
    assert not [p for p in (killed / "shards").iterdir() if p.name.startswith(".tmp-")]
    verify_cache(str(killed))
    a, b = manifest.read_manifest(str(clean))["extra"], manifest.read_manifest(str(killed))["extra"]
    assert [s["checksums"] for s in a["shards"]] == [s["checksums"] for s in b["shards"]]
    assert a["num_tokens"] == b["num_tokens"] and a["bytes"] == b["bytes"]
