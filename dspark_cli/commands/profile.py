"""`dspark profile`: the target's verification steps/s as a function of batch tokens B.

    dspark profile --target runs/x/target --batch-tokens 1,2,4,8,16,32,64 -o runs/x/profile

B tokens are timed as the decoder verifies them: ⌈B / --tokens-per-row⌉ requests in one batched
forward (padded, masked, per-row positions), each over a cached context of --context-length.

Writes sps.json (the SPS table `dspark eval --sps` reads) and sps.png.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..console import console, out
from ..stage import say_if_done
from ._common import load
from ._options import ConfigOpt, ForceOpt, SetOpt, TargetOpt


def profile_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    force: ForceOpt = False,
    target: TargetOpt = None,
    output: Annotated[str | None, typer.Option("--output", "-o",
                                               help="Output URL (default: <work_dir>/profile).")] = None,
    batch_tokens: Annotated[str | None, typer.Option(
        help="Comma list of B to measure (default 1,2,3,4,6,8,12,…,256).")] = None,
    context_length: Annotated[int, typer.Option(help="Cached context length each step attends to.")] = 128,
    repeats: Annotated[int, typer.Option(help="Timed repeats per B (the median is kept).")] = 5,
    tokens_per_row: Annotated[int, typer.Option(
        help="Tokens per request of a round (γ + 1): B is split over ⌈B / this⌉ requests.")] = 8,
    dtype: Annotated[str | None, typer.Option(
        help="auto, bfloat16, float16 or float32 (target.dtype).")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda, cuda:N (target.device).")] = None,
) -> None:
    """Measure SPS(B) on this hardware."""
    from ..errors import DsparkError

    cfg = load(config, set_, target={"model": target, "dtype": dtype, "device": device})
    try:
        grid = [int(b) for b in batch_tokens.split(",") if b.strip()] if batch_tokens else None
    except ValueError:
        raise DsparkError(f"--batch-tokens {batch_tokens!r}: expected comma-separated integers.") from None
    if grid is not None and (not grid or min(grid) < 1):
        raise DsparkError(f"--batch-tokens {batch_tokens!r}: every B must be >= 1.")
    if repeats < 1 or context_length < 1 or tokens_per_row < 1:
        raise DsparkError("--repeats, --context-length and --tokens-per-row must be >= 1.")
    output = output or cfg.stage_url("profile")
    console.print(f"[cyan]▶[/] profile: {cfg.target.model} → {output}")
    from ..decode.stages import run_profile  # torch: only once the flags are known good

    result = run_profile(cfg, cfg.target.model, output, grid, context_length, repeats, force=force,
                         tokens_per_row=tokens_per_row)
    say_if_done(result, "profile", "use --force to rerun")
    table = result.summary
    for b, s in zip(table["batch_tokens"], table["steps_per_second"], strict=True):
        out.print(f"B={b:5d}  {s:9.2f} steps/s  {b * s:10.1f} tokens/s")
    out.print(f"SPS table: {table['sps']}")


def register(app: typer.Typer) -> None:
    """Add the `profile` command to the app."""
    app.command("profile")(profile_cmd)
