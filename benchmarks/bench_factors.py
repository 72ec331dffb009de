"""Why is τ(DSpark)/τ(DFlash) what it is? One factor at a time, at a reduced budget.

    .venv/bin/python -m benchmarks.bench_factors                 # make bench-factors
    .venv/bin/python -m benchmarks.bench_factors --only base,layers-top
    .venv/bin/python -m benchmarks.bench_factors --report-only

bench-quality measures the paper's claim once, at full size. When its ratio misses the goal, the
question is which of the things the issue names limits it: data volume, training budget (measured
by bench-quality itself at 148 vs 296 steps), layer choice, anchors per sequence. This benchmark
trains the DSpark/DFlash pair once per variant, each variant changing one thing against `base`
(the demo's data, cache and config), every pair with the same number of optimizer steps, and
scores each drafter two ways:

- **offline**: teacher-forced acceptance on the cache's validation split (the trainer's
  end-of-training score: seconds, but contexts are the regenerated answers);
- **live**: speculative decoding at T = 1 on the held-out GSM8K, HumanEval (and MT-Bench when
  ../shared/eval_datasets is present) prompts, `--limit` conversations each, no target-only run.

Offline figures compare only between variants that share the cache's validation split (all but
the data variants, which prepare their own prompts). `--offline-only` trains and scores a pair
without decoding (no live eval: saves about 9 minutes per pair).

It also prints the ceiling the live conditional acceptances put on the ratio: the ratio each
pair would reach if the first draft position were always accepted, which no amount of
first-slot improvement can beat. It needs the demo's work root (`make demo`): prompts, responses, cache.
Every stage is a `dspark` call with its own manifest, so a rerun only redoes what changed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import (
    DFLASH_CFG,
    DSPARK_CFG,
    REPO,
    WHOLE_BLOCK,
    add_stage_options,
    config,
    dspark,
    eval_sets,
    fmt,
    macro,
    output,
    run_benchmark,
    run_shared_stages,
    stage_environment,
)
from dspark_cli.config import PipelineConfig
from dspark_cli.decode.report import tau_from_conditional
from dspark_cli.report import pooled_conditional

#: Each variant changes one thing against `base` (the demo config): its data, cache or training.
VARIANTS: dict[str, dict[str, object]] = {
    "base": {},
    "data-half": {"data": ["data.limit=160"], "epochs": 16},  # half the answers, same steps
    "layers-top": {"layers": "1,8,15,22,29"},       # the same spread, ending at the last layer
    "steps-4x": {"steps": 592, "epochs": 16},       # 4x base's optimizer steps (bench-quality: 2x)
    "anchors-48": {"num_anchors": 48},              # twice the anchors per sequence (24 in base)
    # answers sampled at T 0.7 / top-p 0.8 / top-k 20 (the demo's default until it moved to the
    # eval's T = 1, nothing filtered: bench-quality measured both, docs/demo.md)
    "regen-t07": {"data": ["regen.temperature=0.7", "regen.top_p=0.8", "regen.top_k=20"]},
}
DRAFTERS = (("dspark", DSPARK_CFG), ("dflash", DFLASH_CFG))


def prepare_variant(cfg: PipelineConfig, vroot: Path, spec: dict, sets: list[str]) -> Path:
    """The cache this variant trains on: the demo's, or one rebuilt for its data or layers."""
    if "data" in spec:  # its own prompts → regenerated answers → cache, as the pipeline runs them
        variant = run_shared_stages(DSPARK_CFG, vroot, [*sets, *spec["data"]], {})
        return output(variant, "cache")
    if "layers" in spec:
        dspark("cache", "build", "-c", DSPARK_CFG, "--set", f"pipeline.work_dir={cfg.pipeline.work_dir}",
               "--responses", str(output(cfg, "regen")), "-o", str(vroot / "cache"),
               "--layers", str(spec["layers"]), *(a for s in sets for a in ("--set", s)))
        return vroot / "cache"
    return output(cfg, "cache")


def run_variant(args: argparse.Namespace, cfg: PipelineConfig, name: str, spec: dict) -> dict[str, float]:
    work = Path(cfg.pipeline.work_dir)
    vroot = work / "factors" / name
    vroot.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t = time.time()
    cache = prepare_variant(cfg, vroot, spec, args.sets)
    timings["data"] = time.time() - t
    shared = ["--set", f"pipeline.work_dir={work}"]
    anchors = ["--num-anchors", str(spec["num_anchors"])] if "num_anchors" in spec else []
    layers = ["--set", f"target.layers=[{spec['layers']}]"] if "layers" in spec else []
    datasets = [a for path in eval_sets(cfg, args) for a in ("--dataset", path)]
    for drafter, path in DRAFTERS:
        t = time.time()
        dspark("train", "-c", path, *shared, "--cache", str(cache), "-o", str(vroot / f"train-{drafter}"),
               "--epochs", str(spec.get("epochs", 8)), "--max-steps", str(spec.get("steps", args.steps)),
               *anchors, *layers, *args.set_flags)
        timings[f"train_{drafter}"] = time.time() - t
        if args.offline_only:
            continue
        t = time.time()
        dspark("eval", "-c", path, *shared, "--drafter", str(vroot / f"train-{drafter}"), *datasets,
               "--limit", str(args.limit), "--temperature", "1.0",
               "--max-new-tokens", str(args.max_new_tokens), "-o", str(vroot / f"eval-{drafter}"),
               "--set", "eval.baseline=false", "--set", "eval.calibration=", *WHOLE_BLOCK, *layers,
               *args.set_flags)
        timings[f"eval_{drafter}"] = time.time() - t
    return timings


def score(work: Path, name: str) -> dict | None:
    """Offline and live acceptance of one variant's pair; None until both are trained.

    A pair trained with --offline-only has no live figures (None): the table shows dashes there.
    """
    vroot = work / "factors" / name
    out: dict = {"variant": name}
    for drafter, _ in DRAFTERS:
        report_path = vroot / f"eval-{drafter}" / "report.json"
        train_manifest = vroot / f"train-{drafter}" / "manifest.json"
        if not train_manifest.is_file():
            return None
        report = json.loads(report_path.read_text()) if report_path.is_file() else None
        trained = json.loads(train_manifest.read_text())
        extra = trained["extra"]
        out[drafter] = {
            "tau": macro([d["tau"] for d in report["datasets"]]) if report else None,
            "tau_by_dataset": {d["name"]: d["tau"] for d in report["datasets"]} if report else None,
            "conditional": pooled_conditional(report) if report else None,
            "offline_tau": (extra.get("validation") or {}).get("accepted_length"),
            "offline_acceptance": (extra.get("validation") or {}).get("slot_acceptance"),
            "train_samples": trained["counts"]["train_samples"],
            "steps": trained["counts"]["steps"],
        }
    ds, df = out["dspark"], out["dflash"]
    live = ds["tau"] is not None and df["tau"] is not None
    out["ratio"] = ds["tau"] / df["tau"] if live else None
    out["offline_ratio"] = (ds["offline_tau"] / df["offline_tau"]
                            if ds["offline_tau"] and df["offline_tau"] else None)
    out["ratio_if_p1_were_1"] = (tau_from_conditional(ds["conditional"], first=1.0)
                                 / tau_from_conditional(df["conditional"], first=1.0)) if live else None
    return out


def _pair_formatter(df: dict, ds: dict):
    """"DFlash / DSpark" for position k of a per-position list (dashes where it is missing)."""
    def pair(key: str, k: int) -> str:
        return " / ".join(fmt(m[key][k] if m[key] else None) for m in (df, ds))
    return pair


def markdown(rows: list[dict], steps: int, limit: int, max_new_tokens: int) -> str:
    head = ("| Variant | train answers | steps | τ DFlash | τ DSpark | ratio | p₁ DFlash / DSpark "
            "| p₂ DFlash / DSpark | ratio if p₁ = 1 | offline p₁ DFlash / DSpark | offline ratio |")
    lines = [f"Optimizer steps per drafter: {steps} unless the row says otherwise; live: T=1, "
             f"{limit} conversations per dataset, ≤{max_new_tokens} new tokens; "
             "p_k = conditional acceptance at draft position k (pooled).",
             "", head, "|---" * 11 + "|"]
    for r in rows:
        ds, df = r["dspark"], r["dflash"]
        pair = _pair_formatter(df, ds)
        lines.append(
            f"| {r['variant']} | {ds['train_samples']} | {ds['steps']} | {fmt(df['tau'])} | {fmt(ds['tau'])} "
            f"| {fmt(r['ratio'], '{:.3f}')} | {pair('conditional', 0)} | {pair('conditional', 1)} "
            f"| {fmt(r['ratio_if_p1_were_1'], '{:.3f}')} | {pair('offline_acceptance', 0)} "
            f"| {fmt(r['offline_ratio'], '{:.3f}')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/smollm2-135m-dspark", help="The demo's work root.")
    ap.add_argument("--only", default=",".join(VARIANTS), help="Comma-separated variants to run.")
    ap.add_argument("--steps", type=int, default=148,
                    help="Optimizer steps per drafter (bench-quality: 592).")
    ap.add_argument("--limit", type=int, default=10, help="Conversations per eval dataset.")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    add_stage_options(ap)
    ap.add_argument("--offline-only", action="store_true",
                    help="Train the pairs and score them offline only (no speculative decoding).")
    ap.add_argument("--report-only", action="store_true", help="Only summarise finished variants.")
    args = ap.parse_args()
    stage_environment(args)
    work = (REPO / args.work).resolve()
    cfg, _pairs = config(DSPARK_CFG, work, args.sets)
    if not (output(cfg, "cache") / "manifest.json").is_file():
        raise SystemExit(f"{work}/cache has no manifest: run `make demo` first (it builds the shared "
                         "stages).")
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--only: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    timings: dict[str, dict[str, float]] = {}
    if not args.report_only:
        for name in names:
            timings[name] = run_variant(args, cfg, name, VARIANTS[name])
    rows = [r for r in (score(work, n) for n in VARIANTS) if r is not None]
    if not rows:
        raise SystemExit("no variant has both evals yet")
    text = markdown(rows, args.steps, args.limit, args.max_new_tokens)
    result = {"rows": rows, "timings_s": timings}
    (work / "bench_factors.json").write_text(json.dumps(result, indent=2) + "\n")
    (work / "bench_factors.md").write_text(text + "\n")
    print("\n" + text)
    for name, t in timings.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.0f}s" for k, v in t.items()))


if __name__ == "__main__":
    run_benchmark(main)
