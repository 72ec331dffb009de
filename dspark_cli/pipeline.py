"""`dspark pipeline run`: every stage of a pipeline config, in order, each in its own process.

Each stage is the same `dspark …` command a user would type, so the pipeline inherits every stage's
restart rules: a finished stage says "nothing to do", an interrupted one resumes. A separate process
per stage keeps one stage's memory (the target, the drafter) from leaking into the next and lets a
crash name the stage that failed. With `[regen] serve_target = true` the runner starts
`dspark serve` on the target for the regen stage (`serve.process.regen_endpoints`: the server
dies with the runner, even on kill -9; laptops and demos — production points regen at vLLM or
SGLang).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

from . import manifest, storage
from .config import PipelineConfig, load_config
from .console import console
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
        calibration = storage.join(cfg.stage_url("calibration"), "calibration.json")
        if cfg.model.enable_confidence_head and storage.exists(calibration):
            args += ["--calibration", calibration]
    return args


def run_stage(stage: str, cfg: PipelineConfig, config_path: str, sets: list[str], force: bool) -> None:
    args = stage_args(stage, cfg, config_path, sets, force)
    output_url = cfg.stage_url(STAGE_COMMANDS[stage][1])
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
    outcomes = []
    for stage in parse_stages(stages):
        start = time.time()
        run_stage(stage, cfg, config_path, sets, force)
        outcomes.append(StageOutcome(stage, time.time() - start, cfg.stage_url(STAGE_COMMANDS[stage][1])))
    return outcomes
