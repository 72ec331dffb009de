"""`dspark eval`: speculative decoding with the real target, and the losslessness audit.

    dspark eval --target runs/x/target --drafter runs/x/train \\
        --dataset gsm8k.jsonl --dataset mt-bench.jsonl --limit 20 --max-new-tokens 256
    dspark eval … --schedule algorithm1 --concurrency 8 --sps runs/x/profile/sps.json \\
        --calibration runs/x/calibration/calibration.json
    dspark eval audit --samples 4000
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..console import console, out
from ..stage import say_if_done
from ._common import load
from ._options import ConfigOpt, DeviceOpt, DrafterOpt, ForceOpt, SetOpt, TargetOpt

eval_app = typer.Typer(help="Speculative decoding with the real target; the losslessness audit.",
                       invoke_without_command=True, rich_markup_mode=None)


@eval_app.callback(invoke_without_command=True)
def eval_cmd(
    ctx: typer.Context,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    force: ForceOpt = False,
    target: TargetOpt = None,
    device: DeviceOpt = None,
    drafter: DrafterOpt = None,
    dataset: Annotated[list[str] | None, typer.Option(
        help='{"turns": [...]} JSONL or a prompt/response artifact URL (repeatable).')] = None,
    output: Annotated[str | None, typer.Option("--output", "-o",
                                               help="Output URL (default: <work_dir>/eval).")] = None,
    limit: Annotated[int | None, typer.Option(help="Conversations per dataset.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens generated per turn at most.")] = None,
    temperature: Annotated[float | None, typer.Option(
        help="Sampling temperature (0: greedy; default 1.0).")] = None,
    thinking: Annotated[bool | None, typer.Option("--thinking/--no-thinking",
                                                  help="enable_thinking of the chat template.")] = None,
    schedule: Annotated[str | None, typer.Option(help="fixed, threshold, algorithm1 or async.")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Requests scheduled together per round.")] = None,
    concurrency_sweep: Annotated[str | None, typer.Option(
        help="Extra concurrencies (comma list) for budget per request vs R.")] = None,
    threshold: Annotated[float | None, typer.Option(help="Cut of the threshold schedule.")] = None,
    sps: Annotated[str | None, typer.Option(help="SPS table JSON from `dspark profile`.")] = None,
    calibration: Annotated[str | None, typer.Option(help="STS JSON from `dspark calibrate`.")] = None,
    draft_top_k: Annotated[int | None, typer.Option(
        help="Drafter candidates per slot for the Markov bias (0: whole vocabulary; default 64).")] = None,
    baseline: Annotated[bool | None, typer.Option(
        "--baseline/--no-baseline", help="Also decode with the target alone (tokens/s).")] = None,
) -> None:
    """Decode each dataset with target + drafter; write report.json, acceptance.png."""
    if ctx.invoked_subcommand is not None:
        return
    from ..decode.report import render_scheduler_table, render_table
    from ..decode.stages import run_eval

    cfg = load(config, set_, target={"model": target, "device": device}, eval={
        "datasets": dataset, "drafter": drafter, "limit": limit, "max_new_tokens": max_new_tokens,
        "temperature": temperature, "thinking": thinking, "schedule": schedule, "concurrency": concurrency,
        "concurrency_sweep": concurrency_sweep, "threshold": threshold, "sps": sps,
        "calibration": calibration, "baseline": baseline, "draft_top_k": draft_top_k})
    output = output or cfg.stage_url("eval")
    drafter_url = cfg.eval.drafter or cfg.stage_url("train")
    console.print(f"[cyan]▶[/] eval: {drafter_url} on {cfg.target.model} → {output}")
    result = run_eval(cfg, cfg.target.model, drafter_url, output, force=force)
    say_if_done(result, "eval", "use --force to rerun")
    report = result.summary
    out.print(render_table(report))
    scheduler_table = render_scheduler_table(report)
    if scheduler_table is not None:
        out.print(scheduler_table)
    out.print(f"report: {output}/report.json")
    from ..model.card import refresh_card

    if output == cfg.stage_url("eval"):  # the card reads <work_dir>/eval: only then is it news
        refresh_card(drafter_url)


@eval_app.command("audit")
def audit_cmd(
    samples: Annotated[int, typer.Option(help="Outputs counted per policy and world.")] = 4000,
    seed: Annotated[int, typer.Option()] = 0,
    alpha: Annotated[float, typer.Option(help="Significance level of the chi-square test.")] = 1e-3,
    output: Annotated[str | None, typer.Option("--output", "-o",
                                               help="Also write the results as JSON.")] = None,
) -> None:
    """Chi-square test that each scheduling policy keeps the target's output distribution."""
    from rich.table import Table

    from .. import storage
    from ..decode.audit import run_audit
    from ..errors import DsparkError

    if samples < 100:
        raise DsparkError(f"--samples {samples}: need at least 100 for a meaningful chi-square test.")
    if not 0 < alpha < 1:  # also refuses nan
        raise DsparkError(f"--alpha {alpha}: must be a number between 0 and 1.")
    results = run_audit(samples=samples, seed=seed, alpha=alpha)
    table = Table(title=f"losslessness audit (chi-square, α={alpha:g})")
    for col in ("world", "policy", "samples", "χ²", "dof", "p-value", "first token", "target", "expected",
                "verdict"):
        table.add_column(col, justify="left" if col in ("world", "policy", "verdict") else "right")
    for r in results:
        expected = "lossless" if r.should_be_lossless else "biased"
        verdict = "[green]lossless ✓[/]" if r.passed else "[red]biased ✗[/]"
        verdict += "" if r.as_expected else " [red](unexpected)[/]"
        table.add_row(r.world, r.policy, str(r.samples), f"{r.chi2:.1f}", str(r.dof), f"{r.p_value:.3g}",
                      "/".join(f"{x:.2f}" for x in r.first_token_observed),
                      "/".join(f"{x:.2f}" for x in r.first_token_target), expected, verdict)
    out.print(table)
    if output:
        storage.write_json(output, {"alpha": alpha, "seed": seed, "results": [r.to_dict() for r in results]})
    if not all(r.as_expected for r in results):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the `eval` commands to the app."""
    app.add_typer(eval_app, name="eval")
