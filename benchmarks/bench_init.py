"""A fresh drafter's final-norm gain at init: the release before ("1") vs "auto" (docs/train.md).

    .venv/bin/python -m benchmarks.bench_init                      # make bench-init: demo budget
    .venv/bin/python -m benchmarks.bench_init --gains 1 auto 0.5 auto:10 --steps 40
    .venv/bin/python -m benchmarks.bench_init --runs A/train B/train   # only tabulate finished runs

Each gain is one `dspark train` of the demo config (pipelines/smollm2-135m.toml) on the demo's
own cache (regenerated answers; `make demo` builds it, or the shared stages run here first), the
same seed, samples and anchors, `--set train.init_output_gain=G` (and, for G:S,
`train.output_norm_lr_scale=S`: the final norm's lr S times the rest): only those differ. Prints
the gain each run started with, its step-1 loss and CE, the mean loss of its first and last ten
logged steps, and the held-out validation loss and τ (1 + Σ_k Π_{j≤k}(1 − TV_j) on the cache's
validation split), then both runs' training loss and τ per window of ten logged steps. `--runs`
tabulates train folders instead, an unfinished one too (e.g. bench-quality's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import DSPARK_CFG, REPO, dspark, output, run_shared_stages


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").open()]


def row(folder: Path) -> str:
    """One table row of a train folder (an unfinished one: no validation, gain from its log)."""
    logged = metrics(folder)
    manifest = folder / "manifest.json"
    extra = json.loads(manifest.read_text())["extra"] if manifest.is_file() else {}
    val = extra.get("validation")
    # A finished run of the release before the key started at gain 1; an unfinished one says nothing.
    gain = (extra.get("init_output_gain") or {"gain": 1.0}).get("gain") if extra else None
    held_out = (f"{val['loss']:.4f} | {val['accepted_length']:.4f} | {val['slot_acceptance'][0]:.3f}"
                if val else "— | — | —")

    def mean(part: list[dict]) -> float:
        return sum(r["loss"] for r in part) / len(part)

    return (f"| {folder.name} | {'—' if gain is None else f'{gain:.3g}'} | {logged[-1]['step']} | "
            f"{logged[0]['loss']:.2f} ({logged[0]['ce']:.1f}) | {mean(logged[:10]):.3f} | "
            f"{mean(logged[-10:]):.3f} | {held_out} |")


def paired_windows(folders: list[Path], width: int = 10) -> list[str]:
    """Mean training loss and τ per window of `width` logged steps, the runs side by side (the
    same seed sees the same batches, so a window compares like with like)."""
    runs = [metrics(f) for f in folders]
    n = min(len(r) for r in runs)
    lines = ["| logged steps | " + " | ".join(f"{f.name}: loss, τ" for f in folders) + " |",
             "|---" * (len(folders) + 1) + "|"]
    for lo in range(0, n, width):
        cells = []
        for r in runs:
            part = r[lo:min(lo + width, n)]
            cells.append(f"{sum(x['loss'] for x in part) / len(part):.3f}, "
                         f"{sum(x['accepted_length'] for x in part) / len(part):.3f}")
        lines.append(f"| {runs[0][lo]['step']}–{runs[0][min(lo + width, n) - 1]['step']} | "
                     + " | ".join(cells) + " |")
    return lines


HEADER = ("| run | gain at init | steps | step-1 loss (CE) | mean loss, first 10 logged | "
          "last 10 logged | validation loss | validation τ | slot-1 acceptance |\n"
          + "|---" * 9 + "|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/smollm2-135m-dspark", help="Work root holding the demo's cache.")
    ap.add_argument("--gains", nargs="+", default=["1", "auto", "auto:10"],
                    help="train.init_output_gain values, each optionally :S (train.output_norm_lr_scale=S).")
    ap.add_argument("--steps", type=int, default=None, help="train.max_steps (default: the config's epochs).")
    ap.add_argument("--runs", nargs="+", type=Path, default=None, help="Only tabulate these train folders.")
    args = ap.parse_args()
    if args.runs:
        print("\n".join([HEADER, *(row(folder) for folder in args.runs), "",
                         *paired_windows(args.runs)]))
        return
    work = (REPO / args.work).resolve()
    cfg = run_shared_stages(DSPARK_CFG, work, [], {})
    budget = [] if args.steps is None else ["--set", f"train.max_steps={args.steps}"]
    folders = []
    for variant in args.gains:
        gain, _, scale = variant.partition(":")
        folder = work / f"train-init-{gain}{f'-lr{scale}' if scale else ''}-{args.steps or 'demo'}"
        dspark("train", "-c", DSPARK_CFG, "--set", f"pipeline.work_dir={work}", "--cache",
               str(output(cfg, "cache")), "-o", str(folder), "--set", f"train.init_output_gain={gain}",
               "--set", f"train.output_norm_lr_scale={scale or 1}", "--set", "train.log_every=1", *budget)
        folders.append(folder)
    print("\n" + "\n".join([HEADER, *(row(folder) for folder in folders), "",
                              *paired_windows(folders)]))


if __name__ == "__main__":
    main()
