"""DSpark vs DFlash at small scale (the paper's central claim, Table 1) on SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/bench_quality.py                # make bench-quality
    .venv/bin/python benchmarks/bench_quality.py --report-only  # reprint the last results
    .venv/bin/python benchmarks/bench_quality.py --demo-report runs/smollm2-135m-dspark

One work root (default runs/bench-quality) holds shared stages — prompts, responses (regenerated
by `dspark serve`), cache — and one train/eval per drafter. Both drafters get the same data, the
same backbone and the same training budget (pipelines/smollm2-135m.toml vs
pipelines/smollm2-135m-dflash.toml differ only in heads and loss weights). Both are evaluated at
T = 1.0 on the bundled held-out GSM8K and HumanEval prompts (and MT-Bench from
../shared/eval_datasets when present; the package itself never reads ../shared).

Every stage is a `dspark` CLI call whose manifest makes a rerun skip it when its config and
inputs are unchanged, so a rerun only redoes what changed. Prints τ per dataset + macro average,
the ratio τ(DSpark)/τ(DFlash), the conditional acceptance by position for both (and one plot),
and the STS ECE before/after; writes bench_quality.json and bench_quality.md in the work root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DSPARK_CFG = "pipelines/smollm2-135m.toml"
DFLASH_CFG = "pipelines/smollm2-135m-dflash.toml"
TARGET = "runs/models/smollm2-135m-instruct"
EVAL_SETS = {"gsm8k": "dspark_cli/resources/demo_eval_gsm8k.jsonl",
             "humaneval": "dspark_cli/resources/demo_eval_humaneval.jsonl"}
MT_BENCH = REPO.parent / "shared" / "eval_datasets" / "mt-bench.jsonl"
GOAL_RATIO = 1.10
GOAL_ECE = 0.02


def dspark(*args: str) -> None:
    """One CLI stage; its manifest decides whether there is anything to do."""
    cmd = [sys.executable, "-m", "dspark_cli.cli", *args]
    print(f"\n$ dspark {' '.join(args)}", flush=True)
    started = time.time()
    subprocess.run(cmd, cwd=REPO, check=True)
    print(f"  ({time.time() - started:.0f}s)", flush=True)


def committed(url: Path) -> bool:
    return (url / "manifest.json").is_file()


def run_stages(args: argparse.Namespace, root: Path) -> dict[str, float]:
    """prepare → serve+regen → cache → train ×2 → calibrate → eval ×2; returns seconds per stage."""
    from dspark_cli.serve.process import served

    shared = ["--set", f"pipeline.work_dir={root}"]
    timings: dict[str, float] = {}

    def timed(name: str, *cli: str) -> None:
        t = time.time()
        dspark(*cli)
        timings[name] = timings.get(name, 0.0) + time.time() - t

    if not (REPO / TARGET / "conversion.json").is_file():
        timed("convert", "model", "convert", "--smollm2", TARGET)
    timed("prepare", "data", "prepare", "-c", DSPARK_CFG, *shared, *args.sets)
    t = time.time()
    with served(TARGET, served_model_name=TARGET, log_path=str(root.parent / f"{root.name}-serve.log"),
                args=["--max-batch-size", "32", *(["--threads", str(args.threads)] if args.threads else [])],
                ) as server:
        timings["serve_start"] = time.time() - t
        timed("regen", "data", "regen", "-c", DSPARK_CFG, *shared, "--endpoint", server.base_url,
              "--model", server.model, *args.sets)
    timed("cache", "cache", "build", "-c", DSPARK_CFG, *shared, *args.sets)
    for name, cfg in (("dspark", DSPARK_CFG), ("dflash", DFLASH_CFG)):
        timed(f"train_{name}", "train", "-c", cfg, *shared, "--cache", str(root / "cache"),
              "-o", str(root / f"train-{name}"), *args.sets)
    timed("calibrate", "calibrate", "-c", DSPARK_CFG, *shared, "--drafter", str(root / "train-dspark"),
          "--dataset", str(root / "prompts"), "-o", str(root / "calibration"), *args.sets)
    datasets = [a for path in eval_sets(args) for a in ("--dataset", path)]
    for name, cfg in (("dspark", DSPARK_CFG), ("dflash", DFLASH_CFG)):
        calibration = root / "calibration" / "calibration.json"
        extra = (["--set", f"eval.calibration={calibration}"] if name == "dspark"
                 else ["--set", "eval.baseline=false"])  # the target-only speed is measured once
        if args.no_baseline:
            extra += ["--set", "eval.baseline=false"]
        timed(f"eval_{name}", "eval", "-c", cfg, *shared, "--drafter", str(root / f"train-{name}"),
              *datasets, "--limit", str(args.limit), "--temperature", "1.0",
              "--max-new-tokens", str(args.max_new_tokens), "-o", str(root / f"eval-{name}"),
              *extra, *args.sets)
    return timings


def eval_sets(args: argparse.Namespace) -> list[str]:
    paths = list(EVAL_SETS.values())
    if MT_BENCH.is_file() and not args.no_mt_bench:
        paths.append(str(MT_BENCH))
    return paths


def load_report(root: Path, name: str) -> dict:
    return json.loads((root / f"eval-{name}" / "report.json").read_text())


def macro(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def mean_conditional(report: dict) -> list[float | None]:
    """Conditional acceptance per position, pooled over datasets (accepted / reached)."""
    gamma = report["block_size"]
    reached, accepted = [0] * gamma, [0] * gamma
    for d in report["datasets"]:
        for k in range(gamma):
            reached[k] += d["position_acceptance"]["reached"][k]
            accepted[k] += d["position_acceptance"]["accepted"][k]
    return [a / r if r else None for a, r in zip(accepted, reached, strict=True)]


def fmt(x: float | None, pattern: str = "{:.2f}") -> str:
    return "—" if x is None else pattern.format(x)


def summarise(root: Path, timings: dict[str, float] | None) -> dict:
    reports = {name: load_report(root, name) for name in ("dflash", "dspark")}
    names = [d["name"] for d in reports["dspark"]["datasets"]]
    taus = {m: {d["name"]: d["tau"] for d in r["datasets"]} for m, r in reports.items()}
    for m in taus:
        taus[m]["macro"] = macro([taus[m][n] for n in names])
    ratio = {n: (taus["dspark"][n] / taus["dflash"][n]) if taus["dflash"].get(n) else None
             for n in [*names, "macro"]}
    cal_path = root / "calibration" / "calibration.json"
    cal = json.loads(cal_path.read_text()) if cal_path.is_file() else {}
    speed = {d["name"]: d["tokens_per_second"] for d in reports["dspark"]["datasets"]}
    summary = {
        "work_dir": str(root), "datasets": names, "tau": taus, "ratio": ratio,
        "conditional_acceptance": {m: mean_conditional(r) for m, r in reports.items()},
        "ece_before": cal.get("ece_before"), "ece_after": cal.get("ece_after"),
        "calibration_samples": cal.get("num_samples"), "tokens_per_second": speed,
        "conversations": {d["name"]: d["conversations"] for d in reports["dspark"]["datasets"]},
        "max_new_tokens": reports["dspark"]["max_new_tokens"],
        "temperature": reports["dspark"]["temperature"],
        "timings_s": timings,
        "goals": {"ratio_macro>=1.10": bool(ratio["macro"] and ratio["macro"] >= GOAL_RATIO),
                  "ece_after<=0.02": bool(cal.get("ece_after") is not None and cal["ece_after"] <= GOAL_ECE)},
    }
    plot_conditional(summary, root / "conditional_acceptance.png")
    summary["plot"] = str(root / "conditional_acceptance.png")
    return summary


def plot_conditional(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, style in (("dflash", "s--"), ("dspark", "o-")):
        cond = summary["conditional_acceptance"][m]
        xs = [k + 1 for k, c in enumerate(cond) if c is not None]
        ax.plot(xs, [c for c in cond if c is not None], style,
                label=f"{'DSpark' if m == 'dspark' else 'DFlash'} (τ={fmt(summary['tau'][m]['macro'])})")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | positions < k accepted)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("SmolLM2-135M, T=1, held-out prompts (pooled)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def display(name: str) -> str:
    """demo_eval_gsm8k → GSM8K, mt-bench → MT-Bench: the paper's column names."""
    key = name.removeprefix("demo_eval_").replace("_", "-").lower()
    return {"gsm8k": "GSM8K", "humaneval": "HumanEval", "mt-bench": "MT-Bench"}.get(key, name)


def markdown(summary: dict) -> str:
    names = summary["datasets"]
    head = "| Method | " + " | ".join(display(n) for n in names) + " | Macro avg |"
    rule = "|---" * (len(names) + 2) + "|"
    rows = [f"| {label} | " + " | ".join(fmt(summary["tau"][m][n]) for n in [*names, "macro"]) + " |"
            for m, label in (("dflash", "DFlash"), ("dspark", "DSpark"))]
    rows.append("| τ(DSpark)/τ(DFlash) | " + " | ".join(fmt(summary["ratio"][n], "{:.3f}")
                                                      for n in [*names, "macro"]) + " |")
    gamma = len(summary["conditional_acceptance"]["dspark"])
    cond = ["| Position | " + " | ".join(str(k + 1) for k in range(gamma)) + " |", "|---" * (gamma + 1) + "|"]
    for m, label in (("dflash", "DFlash"), ("dspark", "DSpark")):
        cond.append(f"| {label} | " + " | ".join(fmt(c) for c in summary["conditional_acceptance"][m]) + " |")
    convs = ", ".join(f"{display(n)} {c}" for n, c in summary["conversations"].items())
    return "\n".join([
        f"τ (accepted tokens per verification incl. the bonus token), T={summary['temperature']}, "
        f"γ=7, max_new_tokens={summary['max_new_tokens']}, conversations: {convs}",
        "", head, rule, *rows, "",
        "Conditional acceptance by position (pooled over datasets):", "", *cond, "",
        f"STS calibration of the DSpark confidence head: ECE {fmt(summary['ece_before'], '{:.2%}')} → "
        f"{fmt(summary['ece_after'], '{:.2%}')} ({summary['calibration_samples']} rounds of held-out "
        "validation prompts).",
        f"Plot: {summary['plot']}",
    ])


def demo_report(work_dir: Path) -> None:
    """The short report `make demo` ends with: τ, acceptance by position, ECE, speed, plots."""
    report_path = work_dir / "eval" / "report.json"
    if not report_path.is_file():
        sys.exit(f"{report_path} does not exist yet: run `dspark pipeline run` first.")
    report = json.loads(report_path.read_text())
    cal_path = work_dir / "calibration" / "calibration.json"
    cal = json.loads(cal_path.read_text()) if cal_path.is_file() else {}
    print(f"\nDSpark demo — {work_dir} (T={report['temperature']}, γ={report['block_size']}, "
          f"schedule {report['schedule']})")
    print(f"{'dataset':<10} {'τ':>6} {'spec tok/s':>11} {'target tok/s':>13} {'speedup':>8}   "
          "conditional acceptance by position")
    for d in report["datasets"]:
        tps = d["tokens_per_second"]
        cond = " ".join(fmt(c) for c in d["position_acceptance"]["conditional"])
        print(f"{display(d['name']):<10} {fmt(d['tau']):>6} {fmt(tps['speculative'], '{:.1f}'):>11} "
              f"{fmt(tps['target_only'], '{:.1f}'):>13} {fmt(tps['speedup'], '{:.2f}x'):>8}   {cond}")
    if cal:
        print(f"confidence ECE before/after STS: {cal['ece_before']:.2%} → {cal['ece_after']:.2%} "
              f"({cal['num_samples']} rounds)")
    for plot in (work_dir / "eval" / "acceptance.png", work_dir / "calibration" / "reliability.png"):
        if plot.is_file():
            print(f"plot: {plot}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/bench-quality", help="Work root shared by both drafters.")
    ap.add_argument("--limit", type=int, default=20, help="Conversations per eval dataset.")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-mt-bench", action="store_true", help="Skip ../shared/eval_datasets/mt-bench.jsonl.")
    ap.add_argument("--set", dest="sets_raw", action="append", default=[],
                    help="Config override for every stage (section.key=value), e.g. train.epochs=2.")
    ap.add_argument("--no-baseline", action="store_true",
                    help="Skip target-only decoding (the speed comparison) to save time.")
    ap.add_argument("--report-only", action="store_true", help="Only summarise existing eval reports.")
    ap.add_argument("--demo-report", metavar="WORK_DIR", help="Print the demo's short report and exit.")
    ap.add_argument("--threads", type=int, default=None, help="torch threads in every stage.")
    args = ap.parse_args()
    os.chdir(REPO)  # configs and the target folder are repository-relative
    if args.demo_report:
        demo_report(Path(args.demo_report))
        return
    args.sets = [a for s in args.sets_raw for a in ("--set", s)]
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = (REPO / args.work).resolve() if not Path(args.work).is_absolute() else Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    timings = None if args.report_only else run_stages(args, root)
    summary = summarise(root, timings)
    summary["wall_s"] = None if args.report_only else round(time.time() - started, 1)
    (root / "bench_quality.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (root / "bench_quality.md").write_text(text + "\n")
    print("\n" + text)
    if timings:
        print("\nStage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())
              + f"; total {summary['wall_s']:.0f}s")
    for goal, met in summary["goals"].items():
        print(f"goal {goal}: {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
