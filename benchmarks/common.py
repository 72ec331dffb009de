"""What the benchmarks that drive `dspark` stages share (bench-quality, bench-factors).

Run them as modules from the repository (`python -m benchmarks.bench_quality`), so this module
imports as `benchmarks.common`. Stage outputs are found through the pipeline's own stage list
(`dspark_cli.pipeline.stage_output`), and the shared stages (prepare → regen → cache) run through
the pipeline runner itself (`pipeline.run_stage`: same commands, same `dspark serve` for regen).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dspark_cli.cli import exit_with_error
from dspark_cli.config import PipelineConfig, load_config
from dspark_cli.errors import environment_error
from dspark_cli.pipeline import run_stage, stage_output

REPO = Path(__file__).resolve().parent.parent
DSPARK_CFG = "pipelines/smollm2-135m.toml"
DFLASH_CFG = "pipelines/smollm2-135m-dflash.toml"
MT_BENCH = REPO.parent / "shared" / "eval_datasets" / "mt-bench.jsonl"
#: The stages every drafter of a comparison shares: same prompts, answers and cache.
SHARED_STAGES = ("prepare", "regen", "cache")
#: Every drafter compared on τ verifies its whole block: τ is then what each drafter proposes well
#: (the paper's Table 1 quantity). The demo's threshold schedule is a speed trade that stops
#: verifying where the calibrated survival is low; it cuts DSpark's τ and not DFlash's (no confidence
#: head): bench-quality's 740-step DSpark read τ 1.59 / 1.57 / 1.27 with it on 2026-12-07.
WHOLE_BLOCK = ("--set", "eval.schedule=fixed")


def dspark(*args: str) -> None:
    """One CLI stage; its manifest decides whether there is anything to do. A stage that fails has
    printed its own one-line error: the benchmark stops with its exit code, not a traceback."""
    cmd = [sys.executable, "-m", "dspark_cli.cli", *args]
    print(f"\n$ dspark {' '.join(args)}", flush=True)
    started = time.time()
    code = subprocess.run(cmd, cwd=REPO).returncode
    if code:
        print(f"benchmark stopped: `dspark {args[0]}` exited {code} (its error is above).", file=sys.stderr)
        raise SystemExit(code)
    print(f"  ({time.time() - started:.0f}s)", flush=True)


def config(path: str, work: Path, sets: list[str]) -> tuple[PipelineConfig, list[str]]:
    """The config a benchmark's stages see (work root + its --set pairs), and those pairs."""
    pairs = [f"pipeline.work_dir={work}", *sets]
    return load_config(path, pairs), pairs


def output(cfg: PipelineConfig, stage: str) -> Path:
    """A pipeline stage's output folder (e.g. 'cache' → <work>/cache)."""
    return Path(stage_output(cfg, stage))


def run_shared_stages(path: str, work: Path, sets: list[str], timings: dict[str, float]) -> PipelineConfig:
    """prepare → regen (served by `dspark serve`) → cache under `work`, as `dspark pipeline run`
    runs them; adds each stage's seconds to `timings`."""
    cfg, pairs = config(path, work, sets)
    for stage in SHARED_STAGES:
        started = time.time()
        run_stage(stage, cfg, path, pairs, force=False)
        timings[stage] = timings.get(stage, 0.0) + time.time() - started
    return cfg


def eval_sets(cfg: PipelineConfig, args: argparse.Namespace) -> list[str]:
    """The config's own eval sets (+ MT-Bench from ../shared/eval_datasets when present); its
    absence is said, since the macro average then covers fewer datasets than the goal's."""
    paths = list(cfg.eval.datasets)
    if args.no_mt_bench:
        return paths
    if MT_BENCH.is_file():
        return [*paths, str(MT_BENCH)]
    print(f"bench: {MT_BENCH} not found: MT-Bench left out, the macro average covers "
          f"{len(paths)} datasets (link a shared/ folder beside the checkout, or pass --no-mt-bench).",
          file=sys.stderr)
    return paths


def macro(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def fmt(x: float | None, pattern: str = "{:.2f}") -> str:
    return "—" if x is None else pattern.format(x)


def add_stage_options(ap: argparse.ArgumentParser) -> None:
    """Options every benchmark that drives `dspark` stages shares (bench-quality, bench-factors)."""
    ap.add_argument("--no-mt-bench", action="store_true", help="Skip ../shared/eval_datasets/mt-bench.jsonl.")
    ap.add_argument("--set", dest="sets_raw", action="append", default=[],
                    help="Config override for every stage (section.key=value), e.g. train.epochs=2.")


def stage_environment(args: argparse.Namespace) -> None:
    """Run from the repository (the work roots are relative to it), offline; `args.sets` holds the
    --set values every stage gets, `args.set_flags` the same as `--set` flags."""
    os.chdir(REPO)
    args.sets = list(args.sets_raw)
    args.set_flags = [a for s in args.sets for a in ("--set", s)]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_benchmark(main: Callable[[], None]) -> None:
    """Run a benchmark's main as the CLI runs a command: a user's mistake (a bad --set, a missing
    file) is the CLI's one `error:` line and exit 2, not a traceback."""
    try:
        main()
    except Exception as e:
        mapped = environment_error(e)
        if mapped is None:
            raise
        exit_with_error(mapped, e)
