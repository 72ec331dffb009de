"""`dspark pipeline`: run every stage of a pipeline config in order, or show its resolved config.

    dspark pipeline show pipelines/qwen3-4b.toml --set train.lr=3e-4
    dspark pipeline run pipelines/smollm2-135m.toml
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ..console import out
from ._common import load
from ._options import SetOpt

pipeline_app = typer.Typer(help="Run or inspect a whole pipeline config.", no_args_is_help=True)

ConfigArg = Annotated[str, typer.Argument(help="Pipeline TOML, e.g. pipelines/qwen3-4b.toml.")]


@pipeline_app.command("show")
def show(config: ConfigArg, set_: SetOpt = None) -> None:
    """Print the resolved config (file + --set overrides + defaults) as JSON."""
    cfg = load(config, set_)
    out.print_json(json.dumps(cfg.to_dict()))


def register(app: typer.Typer) -> None:
    app.add_typer(pipeline_app, name="pipeline")
