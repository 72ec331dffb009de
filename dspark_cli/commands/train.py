"""`dspark train`: train a drafter from a cache (its serving folder: commands/export.py).

    dspark train --cache runs/x/cache --output runs/x/train --config pipelines/qwen3-4b.toml
    dspark train --online --responses runs/x/responses --output runs/x/train   # no cache: the
                                                                               # target runs in the loop
    torchrun --nproc_per_node 8 -m dspark_cli.cli train --cache s3://b/cache --output s3://b/train
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..console import out
from ..errors import DsparkError
from ..stage import say_if_done
from ._common import load
from ._options import ConfigOpt, ForceOpt, SetOpt

CacheOpt = Annotated[str | None, typer.Option("--cache", "-i", help="Cache URL (default: <work_dir>/cache).")]
OutputOpt = Annotated[str | None, typer.Option("--output", "-o",
                                               help="Train artifact URL (default: <work_dir>/train).")]
ResponsesOpt = Annotated[str | None, typer.Option(
    "--responses", help="With --online: responses URL (default: <work_dir>/responses).")]
OnlineOpt = Annotated[bool, typer.Option(
    "--online", help="No cache: the target computes the features in the training loop "
                     "(= train.source \"online\").")]
TargetOpt = Annotated[str | None, typer.Option("--target", help="Target folder or id (default: cache's).")]


def train_command(
    cache: CacheOpt = None,
    output: OutputOpt = None,
    target: TargetOpt = None,
    online: OnlineOpt = False,
    responses: ResponsesOpt = None,
    max_steps: Annotated[int | None, typer.Option("--max-steps", help="Stop after this many steps.")] = None,
    epochs: Annotated[int | None, typer.Option("--epochs", help="Passes over the training split.")] = None,
    global_batch: Annotated[int | None, typer.Option("--global-batch", help="Samples per step.")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="Samples per forward.")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Peak learning rate.")] = None,
    num_anchors: Annotated[int | None, typer.Option("--num-anchors", help="Anchors per sample.")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda, cuda:N.")] = None,
    target_dtype: Annotated[str | None, typer.Option(
        "--target-dtype", help="With --online: the target's dtype (= target.dtype).")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    force: ForceOpt = False,
) -> None:
    """Train a DSpark (or DFlash baseline) drafter; resumes from the latest checkpoint after a crash."""
    cfg = load(config, set_, target={"model": target, "dtype": target_dtype},
               train={"max_steps": max_steps, "epochs": epochs, "global_batch": global_batch,
                      "micro_batch": micro_batch, "lr": lr, "num_anchors": num_anchors, "device": device,
                      "source": "online" if online else None})
    output_url = output or cfg.stage_url("train")
    if cfg.train.source == "online":
        from ..train.online import OnlineSource

        if cache is not None:
            raise DsparkError("--cache with online training: the target computes the features, "
                              "nothing reads a cache.", hint="drop --cache (or --online); pass --responses.")
        input_url = responses or cfg.stage_url("responses")
        open_split = OnlineSource(cfg, input_url).open
    else:
        from ..cache.reader import CacheDataset

        if responses is not None:
            raise DsparkError("--responses needs --online (or train.source = \"online\"); a cache-fed "
                              "run reads --cache.", hint="add --online, or pass --cache.")
        input_url = cache or cfg.stage_url("cache")

        def open_split(split: str) -> CacheDataset:
            memory_mb = cfg.train.cache_memory_mb if split == "train" else 0  # validation: read once
            return CacheDataset(input_url, split=split, memory_mb=memory_mb)
    from ..train.trainer import train  # torch: only once the flags and config are known good

    result = train(cfg, input_url, output_url, force=force, open_split=open_split)
    if result.summary:  # rank 0 only
        say_if_done(result, "train")
        out.print_json(data={"output": output_url, **result.summary})


def register(app: typer.Typer) -> None:
    """Add `train` to the app."""
    app.command("train")(train_command)
