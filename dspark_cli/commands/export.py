"""`dspark export`: write a drafter's serving folder, and check it against SGLang and vLLM.

    dspark export runs/x/train/checkpoints/step-00001000 runs/x/export --include-embeddings
    dspark export check runs/x/train/export --calibration runs/x/calibration/calibration.json \\
        --sps runs/x/profile/sps.json

`dspark export CKPT OUT` is short for `dspark export write CKPT OUT`.
"""

from __future__ import annotations

from typing import Annotated

import typer
from typer.core import TyperGroup

from ..console import console, out


class _DefaultWrite(TyperGroup):
    """Route `dspark export CKPT OUT` (no subcommand named) to `write`, as before `check` existed."""

    def parse_args(self, ctx, args):  # noqa: ANN001, ANN201 - click's signature
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["write", *args]
        return super().parse_args(ctx, args)


export_app = typer.Typer(
    cls=_DefaultWrite, no_args_is_help=True, add_completion=False,
    help="Write a drafter's serving folder (`write`, the default) or check one (`check`).",
    rich_markup_mode=None)


@export_app.command("write")
def export_command(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint dir, export folder or train artifact.")],
    out_dir: Annotated[str, typer.Argument(help="Serving folder to write (config.json + weights).")],
    include_embeddings: Annotated[bool, typer.Option("--include-embeddings",
                                  help="Also write the frozen embedding and lm_head.")] = False,
    architecture: Annotated[str | None, typer.Option("--architecture",
                            help="Qwen3DSparkModel (anchor_first) or DFlashDraftModel (fill_in); "
                                 "default: from the drafter's block convention.")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="bfloat16, float16 or float32.")] = "bfloat16",
    target: Annotated[str | None, typer.Option("--target",
                      help="Target for the frozen rows (default: the one used in training).")] = None,
    d2t: Annotated[bool, typer.Option("--d2t",
                   help="A reduced draft vocabulary (model.draft_vocab_size) in vLLM's own form: its "
                        "lm_head rows and the d2t map, N logits a draft slot (SGLang refuses it). Default: "
                        "widened to the target's vocabulary, which both engines load.")] = False,
) -> None:
    """Write the serving folder engines (SGLang, vLLM) load from a checkpoint."""
    from .. import storage
    from ..model.export import check_export_output, export_drafter, load_drafter
    from ..train.checkpoint import say_if_unrefit

    storage.check_output(out_dir, [checkpoint], flag="OUT")
    check_export_output(out_dir)  # before loading anything: seconds, not a traceback at the end
    drafter = load_drafter(checkpoint, target=target)
    say_if_unrefit(checkpoint)
    cfg = export_drafter(drafter, out_dir, include_embeddings=include_embeddings, architecture=architecture,
                         dtype=dtype, d2t=d2t)
    console.print(f"[green]✓[/] export: {out_dir} ({cfg['architectures'][0]}, {dtype})")
    out.print_json(data={"output": out_dir, "architecture": cfg["architectures"][0],
                         "block_size": cfg["block_size"], "include_embeddings": include_embeddings})


@export_app.command("check")
def check_command(
    folder: Annotated[str, typer.Argument(help="Export folder (config.json + model.safetensors).")],
    calibration: Annotated[str | None, typer.Option("--calibration",
                           help="STS file (calibration.json) to check against SGLang's loader.")] = None,
    sps: Annotated[str | None, typer.Option("--sps", help="SPS table (sps.json) to check.")] = None,
    target: Annotated[str | None, typer.Option("--target",
                      help="Target for the launch commands (default: the one used in training).")] = None,
) -> None:
    """Say what SGLang and vLLM load, refuse or silently ignore; print the launch commands.

    Exits 1 when no engine serves the export or SGLang refuses a file given.
    """
    from ..model.engine_check import check_export, render

    report = check_export(folder, calibration=calibration, sps=sps, target=target)
    out.print(render(report), markup=False, highlight=False, soft_wrap=True)
    if not report.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the `export` group (write, check) to the app."""
    app.add_typer(export_app, name="export")
