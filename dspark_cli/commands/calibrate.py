"""`dspark calibrate`: Sequential Temperature Scaling of the drafter's confidence head.

    dspark calibrate --target runs/x/target --drafter runs/x/train --dataset runs/x/prompts
    dspark calibrate … --dataset held_out.jsonl --num-prompts 64 --max-new-tokens 128 --concurrency 8

Writes calibration.json (the STS file serving engines load) and reliability.png.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..console import console, out
from ..stage import say_if_done
from ._common import load
from ._options import ConfigOpt, DeviceOpt, DrafterOpt, ForceOpt, SetOpt, TargetOpt


def calibrate_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    force: ForceOpt = False,
    target: TargetOpt = None,
    device: DeviceOpt = None,
    drafter: DrafterOpt = None,
    dataset: Annotated[str | None, typer.Option(
        help="Prompt/response artifact (validation split) or JSONL (default: <work_dir>/prompts).")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o",
                                               help="Output URL (default: <work_dir>/calibration).")] = None,
    num_prompts: Annotated[int | None, typer.Option(help="Held-out conversations decoded.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens generated per turn at most.")] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature while recording.")] = None,
    concurrency: Annotated[int | None, typer.Option(
        help="Held-out conversations decoded together in one batched round.")] = None,
) -> None:
    """Record confidences and acceptance on held-out prompts; fit T_1..T_γ left to right."""
    from ..decode.stages import run_calibrate

    cfg = load(config, set_, target={"model": target, "device": device}, calibrate={
        "dataset": dataset, "drafter": drafter, "num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
        "temperature": temperature, "concurrency": concurrency})
    output = output or cfg.stage_url("calibration")
    drafter_url = cfg.calibrate.drafter or cfg.stage_url("train")
    dataset_url = cfg.calibrate.dataset or cfg.stage_url("prompts")
    console.print(f"[cyan]▶[/] calibrate: {drafter_url} on {dataset_url} → {output}")
    result = run_calibrate(cfg, cfg.target.model, drafter_url, dataset_url, output, force=force)
    say_if_done(result, "calibrate", "use --force to rerun")
    summary = result.summary
    if "skipped" in summary:
        out.print(f"calibrate: skipped ({summary['skipped']}) → {output}")
        return
    _engines(drafter_url)
    temps = ", ".join(f"{t:.3f}" if fit else f"({t:.0f})"
                      for t, fit in zip(summary["temperatures"], summary["fitted"], strict=True))
    where = "out of sample (cross-fitted)" if summary["ece_source"] == "cross_fit" else "in sample"
    out.print(f"temperatures: [{temps}]  ECE {where} {summary['ece_before']:.4f} → "
              f"{summary['ece_after']:.4f} ({summary['num_samples']} rounds) → {summary['calibration']}")
    if not all(summary["fitted"]):
        out.print("  (1) = kept at 1: too few accepted or rejected prefixes, the best T on the grid's edge, "
                  "or no gain on held-out conversations (calibration.json says which, per position)")


def _engines(drafter_url: str) -> None:
    """The export's card now carries the STS file: rewrite it, print the engines check's line."""
    from ..model.card import refresh_card

    line = refresh_card(drafter_url)
    if line:
        console.print(line)


def register(app: typer.Typer) -> None:
    """Add the `calibrate` command to the app."""
    app.command("calibrate")(calibrate_cmd)
