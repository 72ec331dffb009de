"""`make rehearse`: every stage at Qwen3-4B's real size on this machine, each through the real
`dspark` CLI in its own process, timed, with its peak RSS; then the plan checked against it.

    python -m benchmarks.rehearse                  # Qwen3-4B shapes (~20 GB RAM, run alone)
    python -m benchmarks.rehearse --shape tiny     # the same flow on a 36-layer toy, in a minute

The target is Qwen3-4B's exact architecture (plan.shapes.KNOWN_TARGETS, a real Qwen3ForCausalLM
config.json) with random bf16 weights (benchmarks/random_target.py) and SmolLM2's tokenizer (the
only one available offline; its 49,152 tokens leave mask id 151669 a spare row). Conversations are
the bundled training prompts with their datasets' reference answers (benchmarks/
reference_responses.py); the drafter settings are pipelines/qwen3-4b.toml's own. Each stage prints

    rehearse STAGE seconds=S peak_rss_mb=M

(M: the stage process's peak resident set, MiB, from wait4's rusage), and the plan check prints

    plan-check peak_mb_predicted=P peak_mb_measured=M flops_predicted=F flops_counted=C

P: `dspark plan --device cpu --gpus 1 --cache CACHE`'s per-rank peak for training from the cache;
M: the cache-fed `dspark train` process's peak RSS; F: the plan's FLOPs of one optimizer step at
that step's own sample sizes; C: FlopCounterMode's count of that real step (benchmarks/step_flops.py).
Results also land in <work>/rehearse.json; docs/rehearse.md keeps the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = "pipelines/qwen3-4b.toml"
SMOLLM2 = REPO / "runs" / "models" / "smollm2-135m-instruct"
ENGINES_PY = REPO / ".venv-engines" / "bin" / "python"
#: Qwen3-4B's layout at toy widths (same 36 layers, vocabulary, tying, mask row): the smoke run.
TINY = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 36,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": True}


@dataclass
class Stage:
    name: str
    seconds: float
    peak_rss_mb: float
    rc: int
    log: str


def shape_of(name: str) -> dict:
    from dspark_cli.plan.shapes import KNOWN_TARGETS

    return TINY if name == "tiny" else dict(KNOWN_TARGETS["Qwen/Qwen3-4B"])


# Linux carries a process's RSS high-water mark across fork and exec, so wait4 on a child forked
# from this (large) process reports at least this process's own RSS. A small launcher forks the
# stage instead and hands back the stage's own figure.
_LAUNCHER = """import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_stage(name: str, cmd: list[str], logs: Path, env: dict[str, str]) -> Stage:
    """Run one stage process; its wall seconds and its own peak RSS (wait4's rusage, taken by a
    small launcher so that this process's RSS does not count)."""
    logs.mkdir(parents=True, exist_ok=True)
    log, maxrss = logs / f"{name}.log", logs / f"{name}.maxrss"
    maxrss.unlink(missing_ok=True)
    started = time.perf_counter()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call([sys.executable, "-c", _LAUNCHER, str(maxrss), *cmd], cwd=REPO, env=env,
                             stdout=f, stderr=subprocess.STDOUT)
    peak_kb = int(maxrss.read_text()) if maxrss.exists() else 0
    stage = Stage(name, time.perf_counter() - started, peak_kb / 1024, rc, str(log))
    verdict = "" if stage.rc == 0 else f" FAILED rc={stage.rc} (log {log})"
    print(f"rehearse {name} seconds={stage.seconds:.1f} peak_rss_mb={stage.peak_rss_mb:.0f}{verdict}",
          flush=True)
    if stage.rc != 0:
        print("".join(log.read_text().splitlines(keepends=True)[-15:]), flush=True)
    return stage


def dspark(*args: str) -> list[str]:
    return [sys.executable, "-m", "dspark_cli.cli", *args]


def plan_json(sets: list[str], *flags: str, env: dict[str, str]) -> dict:
    cmd = dspark("plan", CONFIG, "--gpus", "1", "--device", "cpu", "--json", *flags, *sets)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def main() -> None:  # noqa: PLR0915 - one linear script of stages
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["qwen3-4b", "tiny"], default="qwen3-4b")
    ap.add_argument("--work", type=Path, default=None, help="default runs/rehearse (tiny: rehearse-tiny)")
    ap.add_argument("--conversations", type=int, default=24, help="the shortest bundled prompts")
    ap.add_argument("--max-length", type=int, default=112,
                    help="tokens a sample (cache.max_length; the prompts with SmolLM2's template are 80-90)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps of the cache-fed training")
    ap.add_argument("--online-steps", type=int, default=1, help="optimizer steps of the online training")
    ap.add_argument("--global-batch", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--eval-samples", type=int, default=2, help="validation samples scored after training")
    ap.add_argument("--rounds", type=int, default=1, help="prompts of calibrate and of eval")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--cache-dtype", default="float32",
                    help="the target's dtype in cache build (CPU: float32; its bf16 GEMM has no fast kernel "
                         "without AVX-512)")
    ap.add_argument("--tokenizer-from", default=str(SMOLLM2))
    ap.add_argument("--engines-python", type=Path, default=ENGINES_PY, help="the engines' venv python")
    ap.add_argument("--recheck", action="store_true",
                    help="rerun only the plan's side of the plan check against <work>/rehearse.json")
    args = ap.parse_args()

    from benchmarks.reference_responses import response_rows, write_responses

    default = REPO / "runs" / ("rehearse" if args.shape == "qwen3-4b" else "rehearse-tiny")
    work = (args.work or default).resolve()
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    target, responses, cache = work / "target", work / "responses", work / "cache"
    train, online, export = work / "train", work / "train-online", work / "export"
    sets = [f"--set=pipeline.work_dir='{work}'", f"--set=target.model='{target}'",
            "--set=target.device='cpu'", "--set=train.device='cpu'",
            f"--set=cache.max_length={args.max_length}",
            f"--set=train.global_batch={args.global_batch}", f"--set=train.micro_batch={args.micro_batch}",
            "--set=train.save_every=100000", "--set=train.log_every=1",
            f"--set=train.eval_samples={args.eval_samples}"]
    stages: list[Stage] = []

    def stage(name: str, cmd: list[str], extra_env: dict[str, str] | None = None) -> bool:
        s = run_stage(name, cmd, logs, {**env, **(extra_env or {})})
        stages.append(s)
        return s.rc == 0

    if args.recheck:
        result = json.loads((work / "rehearse.json").read_text())
        done = [Stage(**st) for st in result["stages"]]
        result["plan_check"] = plan_check(cache, [*sets, f"--set=train.max_steps={args.steps}"], done, env,
                                          logs, recheck=True)
        result["rechecked"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        (work / "rehearse.json").write_text(json.dumps(result, indent=2))
        (work / "rehearse.md").write_text(table(result))
        return
    shape = shape_of(args.shape)
    ok = stage("target", [sys.executable, "-m", "benchmarks.random_target", "--out", str(target),
                          "--shape", json.dumps(shape), "--tokenizer-from", args.tokenizer_from])
    if not ok:
        sys.exit(1)
    rows = response_rows(args.conversations, shortest=True)
    for old in (responses, cache, train, online, export, work / "calibration", work / "eval"):
        shutil.rmtree(old, ignore_errors=True)  # every stage measured from nothing (the target is reused)
    write_responses(str(responses), rows)
    print(f"rehearse: {len(rows)} conversations ({sum(r['split'] == 'validation' for r in rows)} validation) "
          f"→ {responses}", flush=True)

    ok = stage("cache-build", dspark("cache", "build", "-c", CONFIG, "--responses", str(responses),
                                     "--output", str(cache), "--layers", "1,9,17,25,33", "--dtype",
                                     args.cache_dtype, "--device", "cpu", "--force", *sets))
    trained = ok and stage("train", dspark("train", "-c", CONFIG, "--cache", str(cache), "--output",
                                           str(train), "--max-steps", str(args.steps), "--force", *sets))
    stage("train-online", dspark("train", "-c", CONFIG, "--online", "--responses", str(responses),
                                 "--output", str(online), "--max-steps", str(args.online_steps), "--force",
                                 *sets, "--set=train.eval_samples=0"))  # its forwards: bf16 on CPU, slow
    exported = trained and stage("export", dspark("export", "write", str(train), str(export), "--target",
                                                  str(target)))
    if exported:
        stage("export-check", dspark("export", "check", str(export), "--target", str(target)))
        if (args.engines_python.parent.parent / ".installed-stamp").exists():
            stage("engines", [str(args.engines_python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "tests_engines", "-k", "rehearsal"],
                  {"DSPARK_REHEARSE_EXPORT": str(export), "DSPARK_REHEARSE_TARGET": str(target)})
        else:
            print(f"rehearse engines SKIPPED: {args.engines_python} not installed (make engines-venv)",
                  flush=True)
    if trained:
        decode = ["--max-new-tokens", str(args.max_new_tokens), "--force", *sets]
        stage("calibrate", dspark("calibrate", "-c", CONFIG, "--drafter", str(train), "--dataset",
                                  str(responses), "--num-prompts", str(args.rounds),
                                  "-o", str(work / "calibration"), *decode))
        stage("eval", dspark("eval", "-c", CONFIG, "--drafter", str(train), "--dataset",
                             "package://dspark_cli/resources/demo_eval_gsm8k.jsonl", "--limit",
                             str(args.rounds), "--no-baseline", "-o", str(work / "eval"), *decode))
    check = None
    if trained:
        check = plan_check(cache, [*sets, f"--set=train.max_steps={args.steps}"], stages, env, logs)
    result = {"shape": args.shape, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "argv": sys.argv[1:], "stages": [s.__dict__ for s in stages], "plan_check": check}
    (work / "rehearse.json").write_text(json.dumps(result, indent=2))
    (work / "rehearse.md").write_text(table(result))
    failed = [s.name for s in stages if s.rc != 0]
    verdict = "all stages passed" if not failed else "FAILED: " + ", ".join(failed)
    print(f"rehearse: {verdict}; {work}/rehearse.json")
    sys.exit(1 if failed else 0)


def table(result: dict) -> str:
    """The markdown table docs/rehearse.md keeps: stage, seconds, peak RSS, with date and command."""
    lines = [f"{result['date']}, `python -m benchmarks.rehearse {' '.join(result['argv'])}` "
             f"(shape {result['shape']}):", "", "| stage | seconds | peak RSS (MiB) | |",
             "|---|---:|---:|---|"]
    for s in result["stages"]:
        ok = "ok" if s["rc"] == 0 else "FAILED"
        lines.append(f"| {s['name']} | {s['seconds']:.1f} | {s['peak_rss_mb']:.0f} | {ok} |")
    if result.get("plan_check"):
        lines += ["", check_line(result["plan_check"])]
    return "\n".join(lines) + "\n"


def check_line(check: dict) -> str:
    c = check["cache"]
    return (f"plan-check peak_mb_predicted={c['peak_mb_predicted']:.0f} "
            f"peak_mb_measured={c['peak_mb_measured']:.0f} flops_predicted={check['flops_predicted']:.4g} "
            f"flops_counted={check['flops_counted']:.4g}")


def plan_check(cache: Path, sets: list[str], stages: list[Stage], env: dict[str, str],
               logs: Path, recheck: bool = False) -> dict | None:
    """The plan's peak and FLOPs against the rehearsal's measured peak and counted FLOPs."""
    flops_log = logs / "step-flops.json"
    if recheck:  # the plan's side only, against the figures a finished rehearsal measured
        counted = json.loads(flops_log.read_text())
    else:
        pairs = [a for x in sets for a in ("--set", x.removeprefix("--set="))]
        s = run_stage("step-flops", [sys.executable, "-m", "benchmarks.step_flops", "--config", CONFIG,
                                     "--cache", str(cache), *pairs], logs, env)
        if s.rc != 0:
            return None
        counted = json.loads(Path(s.log).read_text().strip().splitlines()[-1])
        flops_log.write_text(json.dumps(counted, indent=2))
    measured = {st.name: st.peak_rss_mb for st in stages}
    plan = plan_json(sets, "--cache", str(cache), env=env)
    step = plan_json(sets, "--samples", str(plan["data"]["samples"]), "--tokens-per-sample",
                     str(round(counted["tokens_per_sample"])), "--loss-tokens-per-sample",
                     str(round(counted["loss_tokens_per_sample"])), env=env)
    out = {}
    for source, stage_name in (("cache", "train"), ("online", "train-online")):
        predicted = plan["sources"][source]["peak_gib"] * 1024
        out[source] = {"peak_mb_predicted": predicted, "peak_mb_measured": measured.get(stage_name),
                       "memory": plan["sources"][source]["memory"]}
    out["flops_predicted"] = step["sources"]["cache"]["flops_per_step"]
    out["flops_counted"] = counted["flops_counted"]
    c = out["cache"]
    print(check_line(out), flush=True)
    o = out["online"]
    if o["peak_mb_measured"] is not None:
        print(f"plan-check-online peak_mb_predicted={o['peak_mb_predicted']:.0f} "
              f"peak_mb_measured={o['peak_mb_measured']:.0f}", flush=True)
    peak_err = c["peak_mb_predicted"] / c["peak_mb_measured"] - 1
    flops_err = out["flops_predicted"] / out["flops_counted"] - 1
    print(f"plan-check: peak {peak_err:+.1%} (goal within 15%), FLOPs {flops_err:+.1%} (goal within 5%)",
          flush=True)
    return out


if __name__ == "__main__":
    main()
