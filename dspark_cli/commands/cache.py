"""`dspark cache`: capture the target's hidden states into a Zarr cache, and check it.

    dspark cache estimate --responses runs/x/responses --target runs/smollm2 --layers auto
    dspark cache build --responses runs/x/responses --output runs/x/cache --target runs/smollm2 \\
        --layers 1,9,17,25,33
    dspark cache build ... --num-workers 8 --worker-index 3      # or RANK / WORLD_SIZE
    dspark cache finalize runs/x/cache
    dspark cache verify runs/x/cache
    dspark cache inspect runs/x/cache
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from ..console import console, out
from ..errors import DsparkError
from ..stage import say_if_done
from ._common import load
from ._options import ConfigOpt, ForceOpt, SetOpt

cache_app = typer.Typer(help="Target hidden-state cache: build, estimate, verify, inspect, finalize.",
                        no_args_is_help=True, rich_markup_mode=None)

ResponsesOpt = Annotated[str | None, typer.Option("--responses", "-i",
                         help="Responses artifact URL (default: <work_dir>/responses).")]
TargetOpt = Annotated[str | None, typer.Option("--target", help="Target model: local folder or hub id.")]
LayersOpt = Annotated[str | None, typer.Option("--layers", help="Layer ids, e.g. 1,9,17,25,33, or 'auto'.")]
StorageDtypeOpt = Annotated[str | None, typer.Option("--storage-dtype", help="bf16 (lossless) or fp8.")]
MaxLengthOpt = Annotated[int | None, typer.Option("--max-length", help="Truncate samples to N tokens.")]
CacheArg = Annotated[str, typer.Argument(help="Cache URL (path, file://, memory://, s3://).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _layers(value: str | None) -> str | None:
    """--layers as given (target.layers parses it); an empty value is refused, not read as auto."""
    if value is not None and not value.replace(",", "").strip():
        raise DsparkError(f"--layers {value!r} is empty: give 'auto' or layer ids such as 1,9,17,25,33.")
    return value


def _table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=title, show_header=False)
    for key, value in rows.items():
        table.add_row(key, value if isinstance(value, str) else json.dumps(value))
    return table


@cache_app.command("build")
def build(
    responses: ResponsesOpt = None,
    output: Annotated[str | None, typer.Option("--output", "-o",
                      help="Cache URL (default: <work_dir>/cache).")] = None,
    target: TargetOpt = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="Target compute dtype.")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda, cuda:N.")] = None,
    batch_tokens: Annotated[int | None, typer.Option("--batch-tokens", help="Tokens per forward.")] = None,
    layers: LayersOpt = None,
    max_length: MaxLengthOpt = None,
    min_loss_tokens: Annotated[int | None, typer.Option("--min-loss-tokens",
                               help="Skip samples with fewer supervised tokens.")] = None,
    storage_dtype: StorageDtypeOpt = None,
    compression: Annotated[str | None, typer.Option("--compression", help="blosc, zstd or none.")] = None,
    samples_per_shard: Annotated[int | None, typer.Option("--samples-per-shard",
                                 help="Samples per committed shard (unit of resume and of workers).")] = None,
    num_workers: Annotated[int | None, typer.Option("--num-workers", help="Workers sharing a build.")] = None,
    worker_index: Annotated[int | None, typer.Option("--worker-index", help="This worker, 0-based.")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    force: ForceOpt = False,
) -> None:
    """Run the target over the responses and store its layer states (restartable, multi-worker)."""
    from ..cache.build import build_cache

    cfg = load(config, set_,
               target={"model": target, "dtype": dtype, "device": device, "layers": _layers(layers)},
               cache={"batch_tokens": batch_tokens, "max_length": max_length,
                      "min_loss_tokens": min_loss_tokens, "storage_dtype": storage_dtype,
                      "compression": compression,
                      "samples_per_shard": samples_per_shard})
    responses_url = responses or cfg.stage_url("responses")
    output_url = output or cfg.stage_url("cache")
    result = build_cache(cfg, responses_url, output_url, force=force, num_workers=num_workers,
                         worker_index=worker_index)
    if not say_if_done(result, "cache") and result.manifest is not None:
        counts = result.counts
        console.print(f"[green]✓[/] cache: {counts['samples']} samples, {counts['tokens']:,} tokens in "
                      f"{counts['shards']} shards → {output_url} (skipped: {counts['skipped'] or 'none'}).")
    if "cache" in result.summary:
        out.print_json(json.dumps(result.summary["cache"]))


@cache_app.command("estimate")
def estimate(
    responses: ResponsesOpt = None,
    target: TargetOpt = None,
    layers: LayersOpt = None,
    storage_dtype: StorageDtypeOpt = None,
    max_length: MaxLengthOpt = None,
    sample: Annotated[int, typer.Option("--sample", help="Rows to render (scaled to the whole set).")] = 2000,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Bytes the cache will take, before building it (tokenizer + config only)."""
    from ..cache.estimate import estimate_cache
    from ..console import fmt_bytes

    cfg = load(config, set_, target={"model": target, "layers": _layers(layers)},
               cache={"storage_dtype": storage_dtype, "max_length": max_length})
    result = estimate_cache(cfg, responses or cfg.stage_url("responses"), sample=sample)
    if as_json:
        out.print_json(json.dumps(result))
        return
    shown = dict(result)
    for key in ("uncompressed_bytes", "expected_bytes", "reference_bytes", "online_saves_bytes"):
        shown[key] = f"{fmt_bytes(result[key])} ({result[key]:,} B)"
    shown["online training"] = (
        f"`dspark train --online` writes no cache (saves {fmt_bytes(result['online_saves_bytes'])}) and "
        f"costs a target forward per sample per epoch: {result['online_target_forwards_per_epoch']:,} "
        f"forwards, {result['online_target_tokens_per_epoch']:,} tokens each epoch "
        "(the cache pays them once)")
    out.print(_table("cache estimate", shown))


@cache_app.command("verify")
def verify(cache: CacheArg) -> None:
    """Re-read every array of every shard; exit non-zero naming the first bad shard and array."""
    from ..cache.verify import verify_cache

    result = verify_cache(cache, progress=lambda n, total: console.print(f"  verified {n}/{total} shards",
                                                                         end="\r"))
    console.print(f"[green]✓[/] {cache}: {result['shards']} shards, {result['samples']} samples, "
                  f"{result['tokens']:,} tokens intact.")


@cache_app.command("inspect")
def inspect(cache: CacheArg, as_json: JsonOpt = False) -> None:
    """A summary of a cache: target, layers, counts, bytes per token against the reference layout."""
    from ..cache.verify import summary

    result = summary(cache)
    if as_json:
        out.print_json(json.dumps(result))
    else:
        out.print(_table("cache", result))


@cache_app.command("finalize")
def finalize(cache: CacheArg) -> None:
    """Write the manifest of a multi-worker build once every shard is committed."""
    from ..cache.build import finalize_cache

    result = finalize_cache(cache, strict=True)
    console.print(f"[green]✓[/] {cache}: manifest written ({result['counts']['shards']} shards, "
                  f"{result['counts']['samples']} samples).")


def register(app: typer.Typer) -> None:
    """Add the `cache` commands to the app."""
    app.add_typer(cache_app, name="cache")
