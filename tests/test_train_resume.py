"""Resume falls back to the newest intact checkpoint and says which one it skipped and why (issue 29)."""

from __future__ import annotations

import pytest
import torch
from fixtures.drafter import drafter_config

from dspark_cli.errors import DsparkError
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.train import checkpoint as ckpt


def _parts(target):
    torch.manual_seed(0)
    drafter = DSparkDrafter(drafter_config(target, num_draft_layers=1))
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return drafter, optimizer, scheduler


def test_a_damaged_latest_checkpoint_falls_back_to_the_older_one(tiny_qwen3_target, tmp_path, capsys):
    url = str(tmp_path / "train")
    drafter, optimizer, scheduler = _parts(tiny_qwen3_target)
    saved = {}
    for step in (2, 4):
        with torch.no_grad():
            next(p for p in drafter.parameters() if p.requires_grad).add_(1.0)
        ckpt.save_checkpoint(url, step, drafter, optimizer, scheduler, {"epoch": 0}, keep_last=3)
        saved[step] = {k: v.clone() for k, v in drafter.trainable_state_dict().items()}
    newest = tmp_path / "train" / "checkpoints" / "step-00000004"
    (newest / "model.safetensors").write_bytes((newest / "model.safetensors").read_bytes()[:100])

    fresh, opt2, sched2 = _parts(tiny_qwen3_target)
    found = ckpt.resume_checkpoint(url, fresh, opt2, sched2, rank=0)
    assert found is not None and found[0].endswith("step-00000002") and found[1]["step"] == 2
    said = capsys.readouterr().err
    assert "skipping checkpoint" in said and "step-00000004" in said and "model.safetensors" in said
    assert all(torch.equal(v, saved[2][k]) for k, v in fresh.trainable_state_dict().items())

    (newest / "model.safetensors").unlink()  # a committed folder missing a file: skipped as well
    (tmp_path / "train" / "checkpoints" / "step-00000002" / "optimizer.pt").write_bytes(b"not a pickle")
    with pytest.raises(DsparkError, match="every checkpoint is damaged"):
        ckpt.resume_checkpoint(url, *_parts(tiny_qwen3_target), rank=0)
    said = capsys.readouterr().err
    assert "file not found" in said and "optimizer.pt" in said
    assert ckpt.resume_checkpoint(str(tmp_path / "none"), *_parts(tiny_qwen3_target), rank=0) is None
