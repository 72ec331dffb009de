"""`dspark train`: train a drafter from a cache (its serving folder: commands/export.py).

    dspark train --cache runs/x/cache --output runs/x/train --config pipelines/qwen3-4b.toml
    torchrun --nproc_per_node 8 -m dspark_cli.cli train --cache s3://b/cache --output s3://b/train
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..console import out
from ._common import load
from ._options import ConfigOpt, ForceOpt, SetOpt

CacheOpt = Annotated[str | None, typer.Option("--cache", "-i", help="Cache URL (default: <work_dir>/cache).")]
OutputOpt = Annotated[str | None, typer.Option("--output", "-o",
                                               help="Train artifact URL (default: <work_dir>/train).")]
TargetOpt = Annotated[str | None, typer.Option("--target", help="Target folder or id (default: cache's).")]


def train_command(
    cache: CacheOpt = None,
    output: OutputOpt = None,
    target: TargetOpt = None,
    max_steps: Annotated[int | None, typer.Option("--max-steps", help="Stop after this many steps.")] = None,
    epochs: Annotated[int | None, typer.Option("--epochs", help="Passes over the training split.")] = None,
    global_batch: Annotated[int | None, typer.Option("--global-batch", help="Samples per step.")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="Samples per forward.")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Peak learning rate.")] = None,
    num_anchors: Annotated[int | None, typer.Option("--num-anchors", help="Anchors per sample.")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda, cuda:N.")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    force: ForceOpt = False,
) -> None:
    """Train a DSpark (or DFlash baseline) drafter; resumes from the latest checkpoint after a crash."""
    from ..cache.reader import CacheDataset
    from ..train.trainer import train

    cfg = load(config, set_, target={"model": target},
               train={"max_steps": max_steps, "epochs": epochs, "global_batch": global_batch,
                      "micro_batch": micro_batch, "lr": lr, "num_anchors": num_anchors, "device": device})
    output_url = output or cfg.stage_url("train")
    cache_url = cache or cfg.stage_url("cache")
    manifest = train(cfg, cache_url, output_url, force=force,
                     open_split=lambda split: CacheDataset(cache_url, split=split))
    if manifest is not None:
        final = manifest["extra"].get("final_metrics", {})
        out.print_json(data={"output": output_url, "export": manifest["extra"]["export"],
                             "steps": manifest["counts"]["steps"], "loss": final.get("loss"),
                             "accepted_length": final.get("accepted_length")})


def register(app: typer.Typer) -> None:
    """Add `train` to the app."""
    app.command("train")(train_command)
