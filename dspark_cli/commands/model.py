"""`dspark model`: prepare target models for the pipeline.

    dspark model convert SmolLM2-135M-Instruct.Q4_1.gguf runs/models/smollm2-135m-instruct
    dspark model convert HuggingFaceTB/SmolLM2-135M-Instruct runs/models/smollm2
    dspark model convert --smollm2 runs/models/smollm2-135m-instruct
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..console import console, out
from ..errors import DsparkError
from ..stage import nothing_to_do

model_app = typer.Typer(help="Prepare target models (GGUF or hub folder → safetensors folder).",
                        no_args_is_help=True, rich_markup_mode=None)


@model_app.command("convert")
def convert(
    src: Annotated[str | None, typer.Argument(help="A .gguf file, a local model folder or a hub id.")] = None,
    out_dir: Annotated[str | None, typer.Argument(metavar="OUT", help="Output folder (local path).")] = None,
    smollm2: Annotated[bool, typer.Option("--smollm2", help="Use the bundled SmolLM2-135M-Instruct "
                                          "GGUF as SRC (then OUT is the only argument).")] = False,
    dtype: Annotated[str, typer.Option(help="Weight dtype written: float32, bfloat16 or float16.")]
    = "float32",
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code",
                                                    help="Run code from the model repository.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Convert again even if OUT is complete; "
                                        "replace an OUT folder holding other files.")] = False,
) -> None:
    """Write a plain safetensors model folder (config, weights, tokenizer, chat template)."""
    from ..convert import check_out_dir, convert_model, find_smollm2_gguf, read_record

    if smollm2:
        if out_dir is not None:
            raise DsparkError("--smollm2 takes only OUT; drop SRC.",
                              hint="dspark model convert --smollm2 runs/models/smollm2-135m-instruct")
        src, out_dir = str(find_smollm2_gguf()), src
    if src is None or out_dir is None:
        raise DsparkError("model convert needs SRC and OUT (or --smollm2 OUT).",
                          hint="dspark model convert --smollm2 runs/models/smollm2-135m-instruct")
    check_out_dir(Path(out_dir), force)
    record = read_record(out_dir)
    if record and record.get("source") == str(src) and record.get("dtype") == dtype and not force:
        nothing_to_do("model convert", out_dir, "use --force to convert again",
                      why=f"already holds {src} ({dtype})")
        out.print(str(Path(out_dir)))
        return
    console.print(f"[cyan]▶[/] converting {src} → {out_dir} ({dtype})")
    folder = convert_model(src, out_dir, dtype=dtype, trust_remote_code=trust_remote_code, force=force)
    record = read_record(folder) or {}
    console.print(f"[green]✓[/] wrote {folder}: {record.get('architecture')} "
                  f"{record.get('num_hidden_layers')} layers, hidden {record.get('hidden_size')}, "
                  f"vocab {record.get('vocab_size')}; max |Δlogit| vs source "
                  f"{record.get('max_abs_logit_diff', float('nan')):.2e}")
    out.print(str(folder))


def register(app: typer.Typer) -> None:
    """Add the `model` commands to the app."""
    app.add_typer(model_app, name="model")
