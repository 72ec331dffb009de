"""`dspark data`: the first two stages — prompts in, regenerated responses out.

    dspark data prepare --source 'chats/*.jsonl' --output runs/x/prompts --val-fraction 0.05
    dspark data regen --input runs/x/prompts --output runs/x/responses \\
        --endpoint http://gpu1:8000/v1 --endpoint http://gpu2:8000/v1 --model Qwen/Qwen3-4B
    dspark data regen … --retry-errors     # re-run only the prompts recorded as failed

Flags override the config file, `--set section.key=value` overrides both. Both stages resume when
rerun after an interruption and do nothing when already complete.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..console import console, out
from ..stage import say_if_done
from ._common import load
from ._options import ConfigOpt, ForceOpt, SetOpt

data_app = typer.Typer(help="Prepare prompts and regenerate responses with the target.",
                       no_args_is_help=True, rich_markup_mode=None)

OutputOpt = Annotated[str | None, typer.Option("--output", "-o",
                                               help="Output URL (default: <work_dir>/<stage>).")]


@data_app.command("prepare")
def prepare_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    force: ForceOpt = False,
    source: Annotated[str | None, typer.Option(
        "--source", help="HF dataset id, or local JSONL/JSON/Parquet files (globs, comma list).")] = None,
    split: Annotated[str | None, typer.Option(help="Split of a hub dataset.")] = None,
    output: OutputOpt = None,
    limit: Annotated[int | None, typer.Option(help="Keep only the first N usable conversations.")] = None,
    val_fraction: Annotated[float | None, typer.Option(help="Fraction held out for validation.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the train/validation split.")] = None,
    shard_rows: Annotated[int | None, typer.Option(help="Rows per output shard.")] = None,
) -> None:
    """Normalise conversations into prompt shards; bad rows go to quarantine.parquet."""
    from ..data.prepare import prepare

    cfg = load(config, set_, data={"source": source, "split": split, "limit": limit,
                                   "val_fraction": val_fraction, "seed": seed, "shard_rows": shard_rows})
    output = output or cfg.stage_url("prompts")
    console.print(f"[cyan]▶[/] data prepare: {cfg.data.source} → {output}")
    result = prepare(cfg, output, force=force)
    c = result.summary
    say_if_done(result, "data prepare")
    out.print(f"prompts: {c.get('rows')} (train {c.get('train')}, validation {c.get('validation')}), "
              f"duplicates removed: {c.get('duplicates')}, quarantined: {c.get('quarantined')} → {output}")


@data_app.command("regen")
def regen_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    force: ForceOpt = False,
    input_: Annotated[str | None, typer.Option(
        "--input", "-i", help="Prompts artifact URL (default: <work_dir>/prompts).")] = None,
    output: OutputOpt = None,
    endpoint: Annotated[list[str] | None, typer.Option(
        help="OpenAI-compatible base URL, e.g. http://host:8000/v1 (repeatable).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name as the server knows it.")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Requests in flight per endpoint.")] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature (default 0.7).")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling mass (default 0.8).")] = None,
    top_k: Annotated[int | None, typer.Option(help="Sent in extra_body.")] = None,
    min_p: Annotated[float | None, typer.Option(help="Sent in extra_body.")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        help="Longest answer per turn, in tokens (default 2048).")] = None,
    thinking: Annotated[bool | None, typer.Option(
        "--thinking/--no-thinking", help="chat_template_kwargs.enable_thinking (default: off).")] = None,
    api_key_env: Annotated[str | None, typer.Option(
        help="Environment variable holding the API key (default OPENAI_API_KEY).")] = None,
    keep_truncated: Annotated[bool | None, typer.Option(
        "--keep-truncated/--drop-truncated", help="Keep answers cut by max_tokens (default: drop).")] = None,
    keep_empty: Annotated[bool | None, typer.Option(
        "--keep-empty/--drop-empty", help="Keep empty answers (default: drop).")] = None,
    max_retries: Annotated[int | None, typer.Option(help="Retries of transient failures.")] = None,
    max_error_share: Annotated[float | None, typer.Option(
        help="Fail (no manifest; a rerun retries them) when more than this share of prompts "
             "failed (default 0.5).")] = None,
    request_timeout: Annotated[float | None, typer.Option(help="Seconds per request.")] = None,
    batch_rows: Annotated[int | None, typer.Option(help="Rows per committed shard.")] = None,
    retry_errors: Annotated[bool, typer.Option(
        "--retry-errors", help="Re-run only the prompts recorded in the error file.")] = False,
) -> None:
    """Regenerate every assistant turn through OpenAI-compatible endpoints (resumable)."""
    from ..data.regen import regen

    cfg = load(config, set_, regen={
        "endpoints": endpoint or None, "model": model, "concurrency": concurrency,
        "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
        "max_tokens": max_tokens, "thinking": thinking, "api_key_env": api_key_env,
        "keep_truncated": keep_truncated, "keep_empty": keep_empty, "max_retries": max_retries,
        "max_error_share": max_error_share,
        "request_timeout": request_timeout, "batch_rows": batch_rows})
    output = output or cfg.stage_url("responses")
    result = regen(cfg, input_, output, force=force, retry_errors=retry_errors)
    c = result.summary
    say_if_done(result, "data regen", "use --force to rebuild, --retry-errors to retry failures")
    out.print(f"responses: {c.get('responses')} of {c.get('prompts')} prompts, rejected: {c.get('rejected')} "
              f"(truncated {c.get('rejected_truncated')}, empty {c.get('rejected_empty')}), "
              f"errors: {c.get('errors')} → {output}")
    if c.get("errors"):
        console.print(f"[yellow]{c['errors']} prompts failed[/]; see {output}/errors.parquet, "
                      "then rerun with --retry-errors.")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
