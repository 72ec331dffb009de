"""`dspark plan`: a training run's memory, FLOPs, cache bytes and wall time, before renting GPUs.

    dspark plan pipelines/qwen3-4b.toml                      # 8 × 80 GB, 300 TFLOP/s sustained
    dspark plan pipelines/qwen3-14b.toml --gpus 16 --gpu-memory 40 --tflops 250
    dspark plan pipelines/qwen3-4b.toml --samples 200000 --tokens-per-sample 1500 --json
"""

from __future__ import annotations

import math
from typing import Annotated

import typer
from rich.markup import escape

from ..console import console, out
from ._options import SetOpt, TargetOpt

ConfigArg = Annotated[str, typer.Argument(help="Pipeline TOML (e.g. pipelines/qwen3-4b.toml).")]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def plan_cmd(
    config: ConfigArg,
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs (one rank each).")] = 8,
    gpu_memory: Annotated[float, typer.Option("--gpu-memory", help="Memory per GPU, GiB (>= 1).")] = 80.0,
    tflops: Annotated[float, typer.Option("--tflops",
                      help="Sustained bf16 TFLOP/s per GPU the wall time is stated at (> 0).")] = 300.0,
    device: Annotated[str, typer.Option(
        "--device", help="cuda (the plan's cluster) or cpu (this machine's runtime and precision "
                         "rules).")] = "cuda",
    samples: Annotated[int | None, typer.Option(
        "--samples", min=1, help="Training conversations (default: the cache's count, else "
                                 "Open-PerfectBlend's).")] = None,
    tokens: Annotated[int | None, typer.Option("--tokens-per-sample", min=2,
                      help="Mean tokens a sample.")] = None,
    loss_tokens: Annotated[int | None, typer.Option("--loss-tokens-per-sample", min=2,
                           help="Mean answer (supervised) tokens a sample.")] = None,
    cache: Annotated[str | None, typer.Option(
        "--cache", help="A built cache to read the data size from (default: <work_dir>/cache when "
                        "finished).")] = None,
    target: TargetOpt = None,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Per-rank peak memory (from a cache and online), FLOPs per step and epoch, cache bytes, hours."""
    from ..errors import DsparkError
    from ..plan.report import Cluster, make_plan, plan_data
    from ._common import load

    if device not in ("cuda", "cpu"):
        raise DsparkError(f"--device {device!r}: must be cuda or cpu.")
    # checked here, not by typer's min=: nan passes no bound and inf printed a 0.0 h plan
    for flag, value, low in (("--gpu-memory", gpu_memory, 1.0), ("--tflops", tflops, 0.001)):
        if not (math.isfinite(value) and value >= low):
            raise DsparkError(f"{flag} must be a finite number >= {low:g}, got {value:g}.")
    cfg = load(config, set_, target={"model": target})
    data = plan_data(cfg, cache or cfg.stage_url("cache"), samples, tokens, loss_tokens)
    plan = make_plan(cfg, data, Cluster(gpus, gpu_memory, tflops, device))
    if as_json:
        out.print_json(data=plan.to_dict())
        return
    t, d = plan.target, plan.drafter
    p = plan.parameters
    console.print(f"plan: {t['name']} ({t['parameters'] / 1e9:.2f}B, shapes from {t['origin']}) → drafter "
                  f"{d['draft_layers']} layers, γ {d['block_size']}, {d['num_anchors']} anchors, layers "
                  f"{d['layers']}; {p['trainable'] / 1e6:.0f}M trainable, {p['frozen'] / 1e6:.0f}M frozen")
    console.print(f"data: {data.samples:,} samples × {data.tokens_per_sample} tokens "
                  f"({data.loss_tokens_per_sample} answer), {escape(data.origin)}; "
                  f"{plan.steps_per_epoch:,} steps/epoch × {plan.epochs} epochs, "
                  f"global batch {d['global_batch']}, micro batch {d['micro_batch']}")
    console.print(f"cache: {plan.cache_bytes / 1e12:.2f} TB expected ({cfg.cache.storage_dtype}, "
                  f"{cfg.cache.compression})")
    console.print(f"per rank, {gpus} × {gpu_memory:g} GiB, wall time at {tflops:g} TFLOP/s "
                  "sustained a GPU:")
    for name, sp in plan.sources.items():
        m = sp.memory
        verdict = "fits" if sp.fits else "DOES NOT FIT"
        console.print(f"  {name:6} peak {sp.peak_gib:5.1f} GiB {verdict} = states "
                      f"{_gib(m.states + m.ddp_buckets)} + max(activations {_gib(m.activations)} + loss "
                      f"chunk {_gib(m.transient)}, gradients {_gib(m.gradients)}"
                      + (f", checkpoint {_gib(m.checkpoint)}" if m.checkpoint else "") + ") + frozen "
                      f"{_gib(m.frozen)} + batches {_gib(m.batches)} + target {_gib(m.online_target)} "
                      f"+ runtime {_gib(m.runtime)}"
                      + (f" + kept samples {_gib(m.kept)}" if m.kept else ""))
        console.print(f"         {sp.flops_per_step / 1e12:.1f} TFLOP a step, "
                      f"{sp.flops_per_epoch / 1e18:.2f} EFLOP an epoch, {sp.hours:.1f} h for "
                      f"{plan.epochs} epochs on {gpus} GPUs")
    for line in plan.advice:
        console.print(f"[yellow]![/] {line}")


def register(app: typer.Typer) -> None:
    """Add the `plan` command to the app."""
    app.command("plan")(plan_cmd)
