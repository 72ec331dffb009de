"""`dspark pipeline`: run every stage of a pipeline config in order, show its resolved config, or
report what its stages produced.

    dspark pipeline show pipelines/qwen3-4b.toml --set train.lr=3e-4
    dspark pipeline run pipelines/smollm2-135m.toml
    dspark pipeline report pipelines/smollm2-135m.toml
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from ..console import console, out
from ._common import load
from ._options import ForceOpt, SetOpt

pipeline_app = typer.Typer(help="Run or inspect a whole pipeline config.", no_args_is_help=True,
                           rich_markup_mode=None)

ConfigArg = Annotated[str, typer.Argument(help="Pipeline TOML, e.g. pipelines/qwen3-4b.toml.")]


@pipeline_app.command("show")
def show(config: ConfigArg, set_: SetOpt = None) -> None:
    """Print the resolved config (file + --set overrides + defaults) as JSON on stdout, and every
    path it names — inputs, work dir, stage outputs — resolved, on stderr."""
    from ..pipeline import resolved_paths

    cfg = load(config, set_)
    out.print_json(json.dumps(cfg.to_dict()))
    console.print("paths (a config's relative inputs: from its folder; outputs: from this directory)",
                  soft_wrap=True)
    for key, path in resolved_paths(cfg):
        console.print(f"  {key:<20} {path}", soft_wrap=True, highlight=False, markup=False)


@pipeline_app.command("run")
def run(
    config: ConfigArg,
    set_: SetOpt = None,
    stages: Annotated[str | None, typer.Option(
        help="Comma-separated subset: prepare,regen,cache,train,calibrate,eval (default: all).")] = None,
    force: ForceOpt = False,
) -> None:
    """Run every stage in order, skipping finished ones and resuming an interrupted one."""
    from ..pipeline import run_pipeline

    outcomes = run_pipeline(config, set_, stages=stages, force=force)
    table = Table(title="pipeline")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_column("output")
    for o in outcomes:
        table.add_row(o.stage, f"{o.seconds:.1f}", o.output_url)
    out.print(table)


@pipeline_app.command("new")
def new(
    target: Annotated[str, typer.Option(help="Target model folder or hub id.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Where to write the TOML.")],
    force: ForceOpt = False,
) -> None:
    """Write a commented config for your target: layers auto, a checked mask token, eval sets."""
    import os

    from .. import storage
    from ..errors import DsparkError
    from ..recipe import new_config

    if os.path.isdir(output):
        raise DsparkError(f"{output}: is a folder; -o takes the TOML file to write.",
                          hint=f"e.g. -o {os.path.join(output, 'my-pipeline.toml')}")
    if os.path.exists(output) and not force:
        raise DsparkError(f"{output}: already exists.", hint="choose another -o, or pass --force.")
    text, mask = new_config(target)
    storage.write_text(output, text)  # a missing folder is made; a failed write leaves nothing
    load(output, [])  # what we wrote must load
    console.print(f"mask token: {mask.token_id} ({mask.reason})")
    out.print(f"wrote {output}; run it with `dspark pipeline run {output}`")


@pipeline_app.command("report")
def report(
    config: ConfigArg,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Stage seconds, τ per dataset, conditional acceptance, ECE before/after, speed-up, plots."""
    from ..report import collect, render

    figures = collect(load(config, set_))
    if as_json:
        out.print_json(json.dumps(figures))
        return
    for block in render(figures):
        out.print(block)


def register(app: typer.Typer) -> None:
    app.add_typer(pipeline_app, name="pipeline")
