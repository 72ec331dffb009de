"""`dspark pipeline run`: every stage of a pipeline config, in order, each in its own process.

Each stage is the same `dspark …` command a user would type, so the pipeline inherits every stage's
restart rules: a finished stage says "nothing to do", an interrupted one resumes. A separate process
per stage keeps one stage's memory (the target, the drafter) from leaking into the next and lets a
crash name the stage that failed. With `[train] source = "online"` the cache stage is skipped:
train reads the responses and runs the target itself. With `[regen] serve_target = true` the runner starts
`dspark serve` on the target for the regen stage (`serve.process.regen_endpoints`: the server
dies with the runner, even on kill -9; laptops and demos — production points regen at vLLM or
SGLang).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from . import manifest, storage
from .config import SECTIONS, PipelineConfig, load_config
from .console import console
from .data.sources import is_local_source
from .errors import DsparkError
from .serve.process import regen_endpoints

STAGES = ("prepare", "regen", "cache", "train", "calibrate", "eval")

#: Stage name → (CLI words, output directory under pipeline.work_dir).
STAGE_COMMANDS: dict[str, tuple[tuple[str, ...], str]] = {
    "prepare": (("data", "prepare"), "prompts"),
    "regen": (("data", "regen"), "responses"),
    "cache": (("cache", "build"), "cache"),
    "train": (("train",), "train"),
    "calibrate": (("calibrate",), "calibration"),
    "eval": (("eval",), "eval"),
}


def stage_output(cfg: PipelineConfig, stage: str) -> str:
    """Where `dspark pipeline run` has stage write: its folder under pipeline.work_dir."""
    return cfg.stage_url(STAGE_COMMANDS[stage][1])


def resolved_paths(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """(key, location) of every input path the config names, then the work dir and each stage's
    output, as the stages will open them: local paths absolute, hub ids as written."""
    def where(item: str, kind: str) -> str:
        if kind == "model":
            local = os.path.exists(item) or item.startswith(("/", "./", "../")) or "://" in item
        elif kind == "source":
            local = is_local_source(item)
        else:
            local = True
        return storage.canonical(item) if local else item  # hub ids as written

    rows: list[tuple[str, str]] = []
    for name, cls in SECTIONS.items():
        section = getattr(cfg, name)
        for key, kind in cls.input_paths.items():
            value = getattr(section, key)
            items = value if isinstance(value, list) else value.split(",") if kind == "source" else [value]
            items = [i.strip() for i in items if i and i.strip()]
            for n, item in enumerate(items):
                rows.append((f"{name}.{key}" + (f"[{n}]" if len(items) > 1 else ""), where(item, kind)))
    rows.append(("pipeline.work_dir", storage.canonical(cfg.pipeline.work_dir)))
    rows += [(f"{stage} output", storage.canonical(stage_output(cfg, stage))) for stage in STAGES]
    return rows


@dataclass
class StageOutcome:
    stage: str
    seconds: float
    output_url: str


def parse_stages(text: str | None) -> list[str]:
    """'cache,train' → ['cache', 'train'] in pipeline order; None → all stages."""
    if not text:
        return list(STAGES)
    wanted = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise DsparkError(f"--stages: unknown stage '{unknown[0]}'; stages: {', '.join(STAGES)}.")
    return [s for s in STAGES if s in wanted]


def _dspark(*args: str) -> list[str]:
    return [sys.executable, "-m", "dspark_cli.cli", *args]


def stage_args(stage: str, cfg: PipelineConfig, config_path: str, sets: list[str],
               force: bool) -> list[str]:
    words, _ = STAGE_COMMANDS[stage]
    args = [*words, "--config", config_path]
    for s in sets:
        args += ["--set", s]
    if force:
        args.append("--force")
    if stage == "eval" and "calibrate" in STAGES:
        calibration = storage.join(stage_output(cfg, "calibrate"), "calibration.json")
        if cfg.model.enable_confidence_head and storage.exists(calibration):
            args += ["--calibration", calibration]
    return args


def run_stage(stage: str, cfg: PipelineConfig, config_path: str, sets: list[str], force: bool) -> None:
    args = stage_args(stage, cfg, config_path, sets, force)
    output_url = stage_output(cfg, stage)
    serve = stage == "regen" and cfg.regen.serve_target
    if serve and (force or manifest.read_manifest(output_url) is None):
        console.print(f"[cyan]▶[/] pipeline: starting `dspark serve {cfg.target.model}` for regen")
        log = storage.join(cfg.pipeline.work_dir, "serve.log") if storage.is_local(
            storage.url_to_fs(cfg.pipeline.work_dir)[0]) else None
        with regen_endpoints(cfg, log_path=log) as (endpoints, model):
            _run(stage, [*args, *(a for e in endpoints for a in ("--endpoint", e)), "--model", model])
        return
    _run(stage, args)


def _run(stage: str, args: list[str]) -> None:
    console.rule(f"[bold]{stage}[/]: dspark {' '.join(args)}")
    code = subprocess.call(_dspark(*args))
    if code != 0:
        raise DsparkError(f"stage '{stage}' failed (exit {code}); its error is printed above.",
                          hint="fix it, then rerun the same `dspark pipeline run` to resume from there.")


def run_pipeline(config_path: str, sets: list[str] | None = None, stages: str | None = None,
                 force: bool = False) -> list[StageOutcome]:
    """Run the selected stages in order; finished ones report 'nothing to do' in seconds."""
    sets = list(sets or [])
    cfg = load_config(config_path, sets)
    selected = parse_stages(stages)
    if "cache" in selected and cfg.train.source == "online":
        console.print("[dim]pipeline: train.source = \"online\": no cache to build (train runs the "
                      "target over the responses itself).[/]")
        selected.remove("cache")
    preflight(cfg, selected)
    say_cpu_dtypes(cfg)
    outcomes = []
    for stage in selected:
        start = time.time()
        run_stage(stage, cfg, config_path, sets, force)
        outcomes.append(StageOutcome(stage, time.time() - start, stage_output(cfg, stage)))
    return outcomes


def say_cpu_dtypes(cfg: PipelineConfig) -> None:
    """What 'auto' resolved to on this CPU, said once up front: without native bf16 matmuls every
    stage runs fp32, about twice the time of a bf16 CPU (docs/demo.md)."""
    from .target.dtypes import auto_dtype, bf16_autocast, cpu_has_fast_bf16, resolve_device

    target, trainer = resolve_device(cfg.target.device), resolve_device(cfg.train.device)
    slow = [name for name, device, value in (("target.dtype", target, cfg.target.dtype),
                                             ("train.precision", trainer, cfg.train.precision))
            if device.type == "cpu" and value in ("bfloat16", "bf16")]
    if slow and not cpu_has_fast_bf16():
        console.print(f"[yellow]pipeline: {' and '.join(slow)} ask for bf16 on a CPU without native bf16 "
                      "matmuls, where they run ~100x slower than fp32: set them to auto.[/]")
    if "cpu" not in (target.type, trainer.type) or "auto" not in (cfg.target.dtype, cfg.train.precision):
        return
    precision = "bf16" if bf16_autocast(cfg.train.precision, trainer) else "fp32"
    native = "has" if cpu_has_fast_bf16() else "has no"
    console.print(f"[dim]pipeline: target dtype {auto_dtype(cfg.target.dtype, target)}, train precision "
                  f"{precision} (this CPU {native} native bf16 matmuls; DSPARK_CPU_BF16=0/1 overrides).[/]")


def preflight(cfg: PipelineConfig, stages: list[str]) -> None:
    """Check every selected stage's own inputs (those no earlier stage writes) before the first
    starts, so a pipeline never fails at its last stage for a value it had from the start."""
    from .data.sources import expand, is_local_source
    from .target import files

    problems: list[tuple[str, str, str]] = []  # (stage, problem, hint)

    def check(stage: str, fn: Any) -> None:
        try:
            fn()
        except DsparkError as e:
            problems.append((stage, str(e), e.hint or ""))

    todo = [st for st in stages if manifest.read_manifest(stage_output(cfg, st)) is None]
    if "prepare" in todo and is_local_source(cfg.data.source):
        check("prepare", lambda: expand(cfg.data.source))
    if "regen" in todo and not cfg.regen.serve_target and not (cfg.regen.endpoints and cfg.regen.model):
        problems.append(("regen", "regen.endpoints and regen.model must be set (or regen.serve_target).",
                         "--set regen.endpoints=['http://HOST:PORT/v1'] --set regen.model=NAME"))
    elif "regen" in todo and not cfg.regen.serve_target:  # the endpoints answer and serve the model now
        from .data.regen import check_endpoints

        check("regen", lambda: check_endpoints(cfg.regen))
    users = [st for st in todo if st in ("cache", "train", "calibrate", "eval")
             or (st == "regen" and cfg.regen.serve_target)]
    if users:  # the target: a local folder with config.json, or a hub id the hub can serve now
        check(users[0], lambda: files.hub_kwargs(cfg.target.model, cfg.target.revision))
    if "eval" in todo:
        if not cfg.eval.datasets:
            problems.append(("eval", "eval.datasets is empty.",
                             'name {"turns": [...]} JSONL files in [eval] datasets (see pipelines/*.toml).'))
        for url in cfg.eval.datasets:
            if url.endswith((".jsonl", ".json")) and not storage.exists(url):
                problems.append(("eval", f"eval.datasets: {url}: file not found.",
                                 "a config file's relative paths are read from its folder, flags and --set "
                                 "from the working directory (`dspark pipeline show` lists them)."))
    if problems:
        stage, problem, hint = problems[0]
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise DsparkError(f"pipeline: stage {stage} cannot run: {problem}{more}", hint=hint or None)
