"""A fresh drafter's final-norm gain at init: the release before ("1") vs "auto" (docs/train.md).

    .venv/bin/python -m benchmarks.bench_init                      # make bench-init: demo budget
    .venv/bin/python -m benchmarks.bench_init --gains 1 auto 0.5 --steps 40
    .venv/bin/python -m benchmarks.bench_init --runs A/train B/train   # only tabulate finished runs

Each gain is one `dspark train` of the demo config (pipelines/smollm2-135m.toml) on the demo's
own cache (regenerated answers; `make demo` builds it, or the shared stages run here first), the
same seed, samples and anchors, `--set train.init_output_gain=G`: only the init differs. Prints
the gain each run started with, its step-1 loss and CE, the mean loss of its first and last ten
logged steps, and the held-out validation loss and τ (1 + Σ_k Π_{j≤k}(1 − TV_j) on the cache's
validation split). `--runs` tabulates finished train folders instead (e.g. bench-quality's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import DSPARK_CFG, REPO, dspark, output, run_shared_stages


def row(folder: Path) -> str:
    """One table row of a finished train folder."""
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
    extra = json.loads((folder / "manifest.json").read_text())["extra"]
    val = extra["validation"]
    gain = (extra.get("init_output_gain") or {}).get("gain", 1.0)  # runs before the key: gain 1

    def mean(part: list[dict]) -> float:
        return sum(r["loss"] for r in part) / len(part)

    return (f"| {folder.name} | {gain:.3g} | {metrics[-1]['step']} | {metrics[0]['loss']:.2f} "
            f"({metrics[0]['ce']:.1f}) | {mean(metrics[:10]):.3f} | {mean(metrics[-10:]):.3f} | "
            f"{val['loss']:.4f} | {val['accepted_length']:.4f} | {val['slot_acceptance'][0]:.3f} |")


HEADER = ("| run | gain at init | steps | step-1 loss (CE) | mean loss, first 10 logged | "
          "last 10 logged | validation loss | validation τ | slot-1 acceptance |\n"
          + "|---" * 9 + "|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/smollm2-135m-dspark", help="Work root holding the demo's cache.")
    ap.add_argument("--gains", nargs="+", default=["1", "auto"], help='Values of train.init_output_gain.')
    ap.add_argument("--steps", type=int, default=None, help="train.max_steps (default: the config's epochs).")
    ap.add_argument("--runs", nargs="+", type=Path, default=None, help="Only tabulate these train folders.")
    args = ap.parse_args()
    if args.runs:
        print("\n".join([HEADER, *(row(folder) for folder in args.runs)]))
        return
    work = (REPO / args.work).resolve()
    cfg = run_shared_stages(DSPARK_CFG, work, [], {})
    budget = [] if args.steps is None else ["--set", f"train.max_steps={args.steps}"]
    folders = []
    for gain in args.gains:
        folder = work / f"train-init-{gain}-{args.steps or 'demo'}"
        dspark("train", "-c", DSPARK_CFG, "--set", f"pipeline.work_dir={work}", "--cache",
               str(output(cfg, "cache")), "-o", str(folder), "--set", f"train.init_output_gain={gain}",
               "--set", "train.log_every=1", *budget)
        folders.append(folder)
    print("\n" + "\n".join([HEADER, *(row(folder) for folder in folders)]))


if __name__ == "__main__":
    main()
