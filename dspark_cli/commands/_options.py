"""Option aliases shared by every stage command, so flags read the same everywhere."""

from __future__ import annotations

from typing import Annotated

import typer

ConfigOpt = Annotated[
    str | None,
    typer.Option("--config", "-c", help="Pipeline TOML (e.g. pipelines/qwen3-4b.toml)."),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override one config value: section.key=value (repeatable)."),
]
ForceOpt = Annotated[
    bool,
    typer.Option("--force", help="Replace an existing output made with a different config or input."),
]
DeviceOpt = Annotated[
    str | None,
    typer.Option("--device", help="Where the target and drafter run: auto, cpu, cuda or cuda:N "
                                  "(target.device)."),
]
TargetOpt = Annotated[
    str | None,
    typer.Option("--target", help="Target model folder or hub id (target.model)."),
]
DrafterOpt = Annotated[
    str | None,
    typer.Option("--drafter", help="Train artifact, checkpoint dir or export folder "
                                   "(default: <work_dir>/train)."),
]
