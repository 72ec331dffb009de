"""`dspark train` end to end: layout, resume after SIGKILL, 2-rank DDP = 1 process, CLI on a cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.drafter import make_samples
from fixtures.tiny_models import mask_token_id
from safetensors.torch import load as st_load

from dspark_cli import storage
from dspark_cli.config import load_config
from dspark_cli.errors import StageConflictError
from dspark_cli.manifest import read_manifest
from dspark_cli.model.export import load_drafter
from dspark_cli.model.markov_init import embedding_rows
from dspark_cli.train.checkpoint import committed_steps
from dspark_cli.train.trainer import train

DRIVER = str(Path(__file__).resolve().parent / "fixtures" / "train_driver.py")
SMALL = ["model.num_draft_layers=2", "model.block_size=4", "model.markov_rank=16", "train.num_anchors=8",
         "train.global_batch=4", "train.micro_batch=1", "train.log_every=1", "train.save_every=2",
         "train.keep_last=2", "train.loss_chunk_blocks=4", "train.warmup_ratio=0.25"]


def sets_for(target, *extra):
    return [f"target.model={target}", f"target.mask_token_id={mask_token_id(target)}", *SMALL, *extra]


def metrics(url: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_text(storage.join(url, "metrics.jsonl")).splitlines()]


def run_driver(target, output, *sets, nproc: int = 1, kill_after: int = 0) -> subprocess.CompletedProcess:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
              if nproc > 1 else [sys.executable])
    cmd = [*launch, DRIVER, str(target), str(output), "--kill-after-step", str(kill_after)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


@pytest.fixture(scope="module")
def samples(tiny_qwen3_target):
    return make_samples(tiny_qwen3_target, n=8)


def test_train_writes_the_contract_5_layout_on_memory(tiny_qwen3_target, samples, memory_url):
    cfg = load_config(None, sets_for(tiny_qwen3_target, "train.max_steps=4", "train.micro_batch=2"))
    out = storage.join(memory_url, "train")
    result = train(cfg, "features://tiny", out, dataset=samples, validation=samples[:3])
    manifest = result.manifest
    assert result.state == "fresh" and result.summary["steps"] == 4
    assert result.summary["export"] == storage.join(out, "export")
    assert manifest["stage"] == "train" and manifest["counts"]["steps"] == 4
    assert manifest["extra"]["validation"]["samples"] == 3
    # The default init is the previous release's, left out of the stage config so its runs resume.
    assert manifest["extra"]["init_output_gain"] == {"gain": 1.0, "target_logit_std": None,
                                                     "init_logit_std": None}
    assert "init_output_gain" not in manifest["config"]["train"]
    assert committed_steps(out) == [2, 4]  # keep_last = 2
    assert storage.read_text(storage.join(out, "checkpoints", "latest")).strip() == "step-00000004"
    assert storage.exists(storage.join(out, "export", "config.json"))
    assert storage.exists(storage.join(out, "export", "model.safetensors"))
    card = storage.read_text(storage.join(out, "export", "README.md"))  # model card + engines check
    assert "SGLang: loads" in card and "--speculative-algorithm DSPARK" in card
    assert "4 steps × global batch" in card
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"loss", "ce", "tv", "conf_bce", "slot_acceptance", "accepted_length", "conf_error",
                "tokens_per_s", "lr"} <= set(r)
        assert len(r["slot_acceptance"]) == 4 and 1.0 <= r["accepted_length"] <= 5.0
    assert rows[0]["lr"] < rows[1]["lr"]  # warmup, then cosine decay
    assert rows[1]["lr"] > rows[3]["lr"]
    # The exported weights are the last checkpoint's.
    ckpt = st_load(storage.read_bytes(storage.join(out, "checkpoints", "step-00000004", "model.safetensors")))
    export = st_load(storage.read_bytes(storage.join(out, "export", "model.safetensors")))
    assert set(ckpt) == set(export)
    assert torch.equal(ckpt["fc.weight"].to(torch.bfloat16), export["fc.weight"])
    # ...except the confidence head's bias, refitted on the validation samples (and recorded).
    assert manifest["config"]["train"]["fit_confidence_bias"] is True
    assert "detach_confidence_inputs" not in manifest["config"]["train"]  # off: the earlier runs' config
    bias = manifest["extra"]["confidence_bias"]
    assert bias["samples"] == 3 and bias["slots"] > 0 and bias["shift"] != 0
    assert abs(bias["mean_confidence_after"] - bias["mean_target"]) < 1e-6
    assert torch.equal((ckpt["confidence_head.proj.bias"] + bias["shift"]).to(torch.bfloat16),
                       export["confidence_head.proj.bias"])
    # Rerun: nothing to do. Another config: refused, naming the key.
    again = train(cfg, "features://tiny", out, dataset=samples)
    assert again.done and again.manifest == manifest and again.summary == result.summary
    other = load_config(None, sets_for(tiny_qwen3_target, "train.max_steps=4", "train.micro_batch=2",
                                       "train.lr=1e-3"))
    with pytest.raises(StageConflictError, match="train.lr"):
        train(other, "features://tiny", out, dataset=samples)


def test_auto_output_gain_is_recorded_and_fingerprinted(tiny_qwen3_target, samples, memory_url):
    cfg = load_config(None, sets_for(tiny_qwen3_target, "train.max_steps=1", "train.eval_samples=0",
                                     "train.init_output_gain=auto", "train.output_norm_lr_scale=10"))
    manifest = train(cfg, "features://tiny", storage.join(memory_url, "auto"), dataset=samples).manifest
    assert manifest["config"]["train"]["init_output_gain"] == "auto"
    assert manifest["config"]["train"]["output_norm_lr_scale"] == 10
    chosen = manifest["extra"]["init_output_gain"]  # matched to these samples' target states
    assert 0 < chosen["gain"] <= 1 and chosen["target_logit_std"] > 0 and chosen["init_logit_std"] > 0
    # No validation scored: the confidence head keeps its trained bias, and the manifest says why.
    assert manifest["extra"]["confidence_bias"] == {"skipped": "no validation samples"}


def test_a_drafter_without_confidence_head_has_no_bias_to_refit(tiny_qwen3_target, samples, memory_url):
    cfg = load_config(None, sets_for(tiny_qwen3_target, "train.max_steps=1",
                                     "model.enable_confidence_head=false"))
    manifest = train(cfg, "features://tiny", storage.join(memory_url, "nohead"), dataset=samples,
                     validation=samples[:2]).manifest
    assert manifest["extra"]["confidence_bias"] is None
    for key in ("fit_confidence_bias", "detach_confidence_inputs"):  # its runs stay reusable
        assert key not in manifest["config"]["train"], key


def test_a_drafter_without_markov_head_leaves_its_keys_out(tiny_qwen3_target, samples, memory_url):
    sets = sets_for(tiny_qwen3_target, "train.max_steps=1", "train.eval_samples=0", "train.markov_lr_scale=5",
                    "train.markov_init=embedding")
    with_head = train(load_config(None, sets), "features://tiny", storage.join(memory_url, "markov"),
                      dataset=samples).manifest
    assert with_head["config"]["train"]["markov_lr_scale"] == 5
    assert with_head["config"]["train"]["markov_init"] == "embedding"
    trained = load_drafter(storage.join(memory_url, "markov"), target=str(tiny_qwen3_target))
    start = embedding_rows(trained.embed_tokens.weight, trained.config.markov_rank)
    w1 = trained.markov_head.markov_w1.weight.float()  # one step from its start: still close to it
    assert torch.nn.functional.cosine_similarity(w1.flatten(), start.flatten(), dim=0) > 0.9
    no_markov = [*sets, "model.markov_head_type=none", "model.confidence_head_with_markov=false"]
    headless = train(load_config(None, no_markov), "features://tiny", storage.join(memory_url, "nomarkov"),
                     dataset=samples).manifest
    for key in ("markov_lr_scale", "markov_init"):  # a DFlash baseline's runs stay reusable
        assert key not in headless["config"]["train"], key


def test_backbone_init_target_is_recorded_and_its_default_leaves_the_key_out(tiny_qwen3_target, samples,
                                                                             memory_url):
    base = sets_for(tiny_qwen3_target, "train.max_steps=1", "train.eval_samples=0")
    started = train(load_config(None, [*base, "train.backbone_init=target"]), "features://tiny",
                    storage.join(memory_url, "from-target"), dataset=samples).manifest
    assert started["config"]["train"]["backbone_init"] == "target"
    assert started["extra"]["backbone_init"] == {"source_layers": [34, 35], "model_type": "qwen3",
                                                 "qk_norm": "copied"}
    default = train(load_config(None, base), "features://tiny", storage.join(memory_url, "random-init"),
                    dataset=samples).manifest
    assert "backbone_init" not in default["config"]["train"] and "backbone_init" not in default["extra"]


def test_a_run_from_before_the_bias_refit_is_refused_with_the_key_that_keeps_it(
        tiny_qwen3_target, samples, memory_url):
    out = storage.join(memory_url, "earlier")
    earlier = load_config(None, sets_for(tiny_qwen3_target, "train.max_steps=1", "train.eval_samples=0",
                                         "train.fit_confidence_bias=false"))
    first = train(earlier, "features://tiny", out, dataset=samples).manifest
    assert "fit_confidence_bias" not in first["config"]["train"]  # what the earlier release wrote
    now = load_config(None, sets_for(tiny_qwen3_target, "train.max_steps=1", "train.eval_samples=0"))
    with pytest.raises(StageConflictError, match="train.fit_confidence_bias") as refused:
        train(now, "features://tiny", out, dataset=samples)
    assert "train.fit_confidence_bias=false" in refused.value.hint
    assert train(earlier, "features://tiny", out, dataset=samples).done
    # Turning on an opt-in key is another run; the hint names the value that keeps this one.
    detached = load_config(None, sets_for(tiny_qwen3_target, "train.max_steps=1", "train.eval_samples=0",
                                          "train.fit_confidence_bias=false",
                                          "train.detach_confidence_inputs=true"))
    with pytest.raises(StageConflictError, match="train.detach_confidence_inputs") as other:
        train(detached, "features://tiny", out, dataset=samples)
    assert "train.detach_confidence_inputs=false" in other.value.hint
    assert "that run was made at" in other.value.hint
    # The other way round, a run made with the key on, asked for without it: that run was not
    # made at the earlier value, so no hint claims it was.
    on = storage.join(memory_url, "opted-in")
    assert train(detached, "features://tiny", on, dataset=samples).manifest
    with pytest.raises(StageConflictError, match="train.detach_confidence_inputs") as back:
        train(earlier, "features://tiny", on, dataset=samples)
    assert "detach_confidence_inputs=false" not in (back.value.hint or "")


def test_fast_kernels_is_speed_only_same_losses_same_run(tiny_qwen3_target, samples, memory_url):
    """train.fast_kernels changes how the loss is computed, not what: the same losses step by step,
    the same stage config (a run made either way is reused by the other), the same weight names."""
    sets = sets_for(tiny_qwen3_target, "train.max_steps=3", "train.eval_samples=0")
    fast_url, earlier_url = storage.join(memory_url, "fast"), storage.join(memory_url, "earlier-kernels")
    fast = train(load_config(None, sets), "features://tiny", fast_url, dataset=samples).manifest
    earlier = train(load_config(None, [*sets, "train.fast_kernels=false"]), "features://tiny", earlier_url,
                    dataset=samples).manifest
    assert "fast_kernels" not in fast["config"]["train"] and fast["config"] == earlier["config"]
    for a, b in zip(metrics(fast_url), metrics(earlier_url), strict=True):
        assert a["step"] == b["step"]
        for key in ("loss", "ce", "tv", "conf_bce", "accepted_length"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert train(load_config(None, sets), "features://tiny", earlier_url, dataset=samples).done
    names = [st_load(storage.read_bytes(storage.join(url, "export", "model.safetensors"))).keys()
             for url in (fast_url, earlier_url)]
    assert sorted(names[0]) == sorted(names[1])


def test_the_final_norm_gets_its_own_lr_only_when_scaled(tiny_qwen3_target):
    from fixtures.drafter import drafter_config

    from dspark_cli.model.drafter import DSparkDrafter
    from dspark_cli.train.trainer import param_groups

    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target))
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    assert param_groups(drafter, 1e-3, 1.0) == [{"params": trainable}]
    rest, norm = param_groups(drafter, 1e-3, 10.0)
    assert norm["params"] == [drafter.norm.weight] and norm["lr"] == pytest.approx(1e-2)
    assert len(rest["params"]) == len(trainable) - 1 and "lr" not in rest


def test_the_markov_head_gets_its_own_lr_only_when_scaled(tiny_qwen3_target):
    from fixtures.drafter import drafter_config

    from dspark_cli.model.drafter import DSparkDrafter
    from dspark_cli.train.trainer import param_groups

    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target, markov_head_type="gated"))
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    tables = [drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight]
    rest, norm, head = param_groups(drafter, 1e-3, 2.0, 5.0)
    assert head["params"] == tables and head["lr"] == pytest.approx(5e-3)
    assert norm["params"] == [drafter.norm.weight] and norm["lr"] == pytest.approx(2e-3)
    assert len(rest["params"]) + 1 + len(tables) == len(trainable)
    gate = drafter.markov_head.gate_proj.weight  # dense, learns every step: the shared lr
    assert any(p is gate for p in rest["params"])
    headless = DSparkDrafter(drafter_config(tiny_qwen3_target, markov_head_type="none",
                                            confidence_head_with_markov=False))
    assert len(param_groups(headless, 1e-3, 1.0, 5.0)) == 1  # nothing to scale


def test_training_lowers_the_loss(tiny_qwen3_target, samples, tmp_path):
    cfg = load_config(None, sets_for(tiny_qwen3_target, "train.max_steps=8", "train.lr=3e-3",
                                     "train.global_batch=2", "train.save_every=100", "train.eval_samples=0"))
    train(cfg, "features://tiny", str(tmp_path), dataset=samples)
    rows = metrics(str(tmp_path))
    assert rows[-1]["loss"] < 0.9 * rows[0]["loss"]


def test_sigkill_after_a_checkpoint_then_resume_gives_the_same_losses(tiny_qwen3_target, tmp_path):
    sets = ["train.max_steps=8"]
    whole = run_driver(tiny_qwen3_target, tmp_path / "whole", *sets_for(tiny_qwen3_target, *sets))
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = run_driver(tiny_qwen3_target, tmp_path / "killed", *sets_for(tiny_qwen3_target, *sets),
                        kill_after=5)
    assert killed.returncode == -9
    out = str(tmp_path / "killed")
    assert committed_steps(out) == [2, 4] and read_manifest(out) is None
    # A checkpoint being written when the kill came: no marker, so resume must ignore it.
    partial = tmp_path / "killed" / "checkpoints" / "step-00000006"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half a file")
    resumed = run_driver(tiny_qwen3_target, tmp_path / "killed", *sets_for(tiny_qwen3_target, *sets))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr
    a, b = metrics(str(tmp_path / "whole")), metrics(out)
    assert [r["step"] for r in b] == list(range(1, 9))  # every step once: no loss, no duplicate
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-7), ra["step"]
        assert ra["slot_acceptance"] == pytest.approx(rb["slot_acceptance"], rel=1e-5)
    assert committed_steps(out) == [6, 8]
    wa = st_load((tmp_path / "whole" / "export" / "model.safetensors").read_bytes())
    wb = st_load((tmp_path / "killed" / "export" / "model.safetensors").read_bytes())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_rank_ddp_matches_one_process(tiny_qwen3_target, tmp_path):
    sets = sets_for(tiny_qwen3_target, "train.max_steps=3", "train.save_every=100")
    one = run_driver(tiny_qwen3_target, tmp_path / "one", *sets)
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_driver(tiny_qwen3_target, tmp_path / "two", *sets, nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = metrics(str(tmp_path / "one")), metrics(str(tmp_path / "two"))
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5), ra["step"]
        assert ra["anchor_slots"] == rb["anchor_slots"]
    wa = st_load((tmp_path / "one" / "checkpoints" / "step-00000003" / "model.safetensors").read_bytes())
    wb = st_load((tmp_path / "two" / "checkpoints" / "step-00000003" / "model.safetensors").read_bytes())
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5), k
    assert read_manifest(str(tmp_path / "two"))["extra"]["world_size"] == 2


def test_checkpoints_rotation_and_export_on_s3(tiny_qwen3_target, samples, s3_bucket):
    from dspark_cli.model.export import load_drafter

    cfg = load_config(None, sets_for(tiny_qwen3_target, "train.max_steps=3", "train.save_every=1",
                                     "train.keep_last=1", "train.eval_samples=0"))
    out = storage.join(s3_bucket, "runs", "train")
    train(cfg, "features://tiny", out, dataset=samples)
    assert committed_steps(out) == [3]
    assert storage.listdir(storage.join(out, "checkpoints")) == ["latest", "step-00000003"]
    assert load_drafter(out).block_size == 4  # export/ read back from S3
    assert len(metrics(out)) == 3
