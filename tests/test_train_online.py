"""`dspark train --online`: the target runs in the loop; same samples, anchors and loss as a cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fixtures.cache_responses import response_rows, write_responses
from fixtures.tiny_models import mask_token_id

from dspark_cli import storage
from dspark_cli.cache.build import build_cache
from dspark_cli.cache.reader import CacheDataset
from dspark_cli.cli import main
from dspark_cli.config import load_config
from dspark_cli.manifest import read_manifest
from dspark_cli.train.checkpoint import committed_steps
from dspark_cli.train.online import OnlineSource
from dspark_cli.train.trainer import train

DRIVER = str(Path(__file__).resolve().parent / "fixtures" / "train_driver.py")
# min_loss_tokens 8 skips the short rows (short_every below): the skip rules must agree too.
RENDER = ["cache.min_loss_tokens=8", "cache.max_length=48", "cache.samples_per_shard=3"]
SMALL = ["model.num_draft_layers=1", "model.block_size=3", "model.markov_rank=8", "train.num_anchors=6",
         "train.global_batch=2", "train.micro_batch=1", "train.log_every=1", "train.save_every=2",
         "train.keep_last=2", "train.device=cpu", "target.device=cpu", "train.eval_samples=2"]


def sets_for(target, *extra: str) -> list[str]:
    mask = mask_token_id(target)
    return [f"target.model={target}", f"target.mask_token_id={mask}", *RENDER, *SMALL, *extra]


def metrics(url: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_text(storage.join(url, "metrics.jsonl")).splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_qwen3_target) -> tuple[str, str]:
    """(responses, a cache built from them by `cache build`)."""
    root = tmp_path_factory.mktemp("online")
    responses = write_responses(str(root / "responses"), response_rows(14, short_every=6))
    cfg = load_config(None, sets_for(tiny_qwen3_target))
    build_cache(cfg, responses, str(root / "cache"), quiet=True)
    return responses, str(root / "cache")


def test_online_samples_are_the_cache_samples(data, tiny_qwen3_target):
    responses, cache = data
    cfg = load_config(None, sets_for(tiny_qwen3_target))
    source = OnlineSource(cfg, responses, quiet=True)
    for split in ("train", "validation"):
        cached, online = CacheDataset(cache, split=split), source.open(split)
        assert len(online) == len(cached) > 0
        if split == "train":  # indexed with the tokenizer alone: the weights wait for the first forward
            assert source.target is None
        for i in range(len(cached)):
            a, b = cached[i], online[i]
            assert a.sample_id == b.sample_id and a.split == b.split == split
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
            assert b.hidden_states.dtype == torch.bfloat16  # rounded as the cache stores them
            torch.testing.assert_close(b.hidden_states, a.hidden_states, rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(b.final_hidden, a.final_hidden, rtol=1e-2, atol=1e-2)  # [K, d]
    assert source.skipped == read_manifest(cache)["counts"]["skipped"] != {}
    assert online.meta["layers"] == CacheDataset(cache).layers


def test_one_step_online_has_the_loss_of_one_step_from_the_cache(data, tiny_qwen3_target, tmp_path):
    responses, cache = data
    cfg = load_config(None, sets_for(tiny_qwen3_target, "train.max_steps=2"))
    from_cache = train(cfg, cache, str(tmp_path / "cache"),
                       open_split=lambda split: CacheDataset(cache, split=split)).manifest
    online = train(cfg, responses, str(tmp_path / "online"),
                   open_split=OnlineSource(cfg, responses).open).manifest
    a, b = metrics(str(tmp_path / "cache")), metrics(str(tmp_path / "online"))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4, abs=1e-6), ra["step"]
        assert rb["anchor_slots"] == ra["anchor_slots"]  # the same anchors
        assert rb["slot_acceptance"] == pytest.approx(ra["slot_acceptance"], rel=1e-4, abs=1e-6)
        assert rb["target_s"] > 0 and "target_s" not in ra  # online progress shows the target's time
        assert rb["drafter_s"] > 0 and rb["data_wait_s"] >= 0
    assert online["extra"]["validation"]["loss"] == pytest.approx(from_cache["extra"]["validation"]["loss"],
                                                                  rel=1e-4)
    report = online["extra"]["online"]
    assert report["samples"] == read_manifest(cache)["counts"]["samples"] and report["target_tokens"] > 0
    inputs = {i["url"]: i["fingerprint"] for i in online["inputs"]}
    assert inputs[str(tiny_qwen3_target)].startswith("target:") and responses in inputs
    assert online["config"]["online"] == {"max_length": 48, "min_loss_tokens": 8}


def run(*args: str) -> int:
    try:
        main(list(args))
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_cli_online_trains_and_refuses_a_cache_flag(data, tiny_qwen3_target, tmp_path, capsys):
    responses, cache = data
    sets = [a for s in sets_for(tiny_qwen3_target) for a in ("--set", s)]
    out = str(tmp_path / "t")
    code = run("train", "--online", "--responses", responses, "--output", out, "--max-steps", "2", *sets)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["steps"] == 2 and committed_steps(out) == [2]
    assert "target " in captured.err and "drafter " in captured.err  # the per-step split is shown
    # Rerun: done. Without --online the same output is another run (its input is a cache).
    assert run("train", "--online", "--responses", responses, "--output", out, "--max-steps", "2", *sets) == 0
    assert "nothing to do" in capsys.readouterr().err
    code = run("train", "--online", "--cache", cache, "--output", str(tmp_path / "u"), *sets)
    err = capsys.readouterr().err
    assert code == 2 and "error: --cache with online training" in err and "Traceback" not in err
    code = run("train", "--responses", responses, "--output", str(tmp_path / "u"), *sets)
    err = capsys.readouterr().err
    assert code == 2 and "error: --responses needs --online" in err
    code = run("train", "--online", "--responses", cache, "--output", str(tmp_path / "u"), *sets)
    err = capsys.readouterr().err
    assert code == 2 and f"error: --responses {cache}: is a 'cache' artifact, not a 'data.regen' one" in err
    assert not (tmp_path / "u").exists()


def run_driver(target, output, responses, *sets, nproc: int = 1, kill_after: int = 0
               ) -> subprocess.CompletedProcess:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
              if nproc > 1 else [sys.executable])
    cmd = [*launch, DRIVER, str(target), str(output), "--online", responses,
           "--kill-after-step", str(kill_after)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_sigkill_then_resume_online_continues_at_the_same_data_position(data, tiny_qwen3_target, tmp_path):
    responses, _ = data
    sets = sets_for(tiny_qwen3_target, "train.max_steps=6", "train.eval_samples=0")
    whole = run_driver(tiny_qwen3_target, tmp_path / "whole", responses, *sets)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = run_driver(tiny_qwen3_target, tmp_path / "killed", responses, *sets, kill_after=3)
    assert killed.returncode == -9
    out = str(tmp_path / "killed")
    assert committed_steps(out) == [2] and read_manifest(out) is None
    resumed = run_driver(tiny_qwen3_target, tmp_path / "killed", responses, *sets)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr
    a, b = metrics(str(tmp_path / "whole")), metrics(out)
    assert [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-7), ra["step"]
        assert ra["anchor_slots"] == rb["anchor_slots"]


def test_two_ranks_online_match_one_process(data, tiny_qwen3_target, tmp_path):
    """Each rank loads its own target and forwards only its share of each step."""
    responses, _ = data
    sets = sets_for(tiny_qwen3_target, "train.max_steps=2", "train.eval_samples=0")
    one = run_driver(tiny_qwen3_target, tmp_path / "one", responses, *sets)
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_driver(tiny_qwen3_target, tmp_path / "two", responses, *sets, nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = metrics(str(tmp_path / "one")), metrics(str(tmp_path / "two"))
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5), ra["step"]
        assert ra["anchor_slots"] == rb["anchor_slots"]
    one_report = read_manifest(str(tmp_path / "one"))["extra"]["online"]
    two_report = read_manifest(str(tmp_path / "two"))["extra"]["online"]
    assert one_report["samples"] == two_report["samples"] and one_report["skipped"] == two_report["skipped"]
    # rank 0 forwarded half of the training samples the one process did
    assert two_report["target_tokens"] < one_report["target_tokens"]


def test_pipeline_with_online_source_skips_the_cache_stage(tmp_path, capsys):
    from dspark_cli.pipeline import run_pipeline

    config = tmp_path / "p.toml"
    config.write_text(textwrap.dedent(f"""
        [pipeline]
        work_dir = "{tmp_path / 'work'}"
        [train]
        source = "online"
    """))
    assert run_pipeline(str(config), stages="cache") == []
    assert "no cache to build" in capsys.readouterr().err
    assert not (tmp_path / "work" / "cache").exists()
    with pytest.raises(Exception, match="train.source must be one of cache, online"):
        load_config(None, ["train.source=disk"])
