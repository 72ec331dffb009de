"""bench-quality's curve: validation τ of both drafters at every kept checkpoint, and their ratio.

    .venv/bin/python -m benchmarks.quality_curve      # after make bench-quality (its checkpoints)

bench-quality keeps a checkpoint every `CURVE_EVERY` steps of each drafter's run. This scores each
one on the cache's validation split with the trainer's own held-out pass (`train.validate.evaluate`:
the same anchors, seed and sample count as the end-of-training score), so the two drafters'
expected accepted lengths are comparable step for step. It is the offline τ (teacher-forced
contexts), not the live one; bench-quality's live ratio at the last step is printed beside it, which
says how far the offline ratio reads from the live one. Mid-run checkpoints have not reached the
schedule's low lr, so a point is the run at that step, not a shorter run's end.

Prints `bench-quality-curve steps=S dflash=A dspark=B ratio=R` per step; writes
bench_quality_curve.json and bench_quality_curve.png in the work root.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.bench_quality import DRAFTERS, train_dir
from benchmarks.common import DSPARK_CFG, REPO, config, output
from dspark_cli import storage
from dspark_cli.cache.reader import CacheDataset
from dspark_cli.config import load_config
from dspark_cli.model.export import load_drafter
from dspark_cli.settings.train import TrainSettings
from dspark_cli.train import checkpoint as ckpt
from dspark_cli.train.loss import DrafterLoss, LossWeights
from dspark_cli.train.validate import evaluate


def score(checkpoint: str, tc: TrainSettings, validation: CacheDataset) -> float:
    """Validation τ of one checkpoint, scored as the trainer scores its run's end (the frozen
    embedding and lm_head from the target its run recorded)."""
    drafter = load_drafter(checkpoint)
    module = DrafterLoss(drafter, LossWeights(tc.ce_weight, tc.tv_weight, tc.conf_weight, tc.gamma_decay),
                         tc.loss_chunk_blocks, fast_kernels=tc.fast_kernels)
    held_out = evaluate(module, validation, drafter.config, num_anchors=tc.num_anchors, seed=tc.seed,
                        micro_batch=tc.micro_batch, limit=tc.eval_samples, device=torch.device("cpu"),
                        flex=False)
    return float(held_out["accepted_length"])


def live_ratio(root: Path) -> float | None:
    path = root / "bench_quality.json"
    return json.loads(path.read_text())["ratio"]["macro"] if path.is_file() else None


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [p["steps"] for p in points]
    ax.plot(steps, [p["ratio"] for p in points], "o-", label="validation τ(DSpark)/τ(DFlash)")
    ax.axhline(1.15, ls="--", color="grey", label="goal 1.15")
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("ratio")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/smollm2-135m-dspark", help="bench-quality's work root.")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = (REPO / args.work).resolve()
    cfg, _ = config(DSPARK_CFG, root, [])
    validation = CacheDataset(str(output(cfg, "cache")), split="validation")
    runs = {name: str(train_dir(cfg, name)) for name, _ in DRAFTERS}
    steps = sorted(set.intersection(*(set(ckpt.committed_steps(url)) for url in runs.values())))
    if not steps:
        raise SystemExit(f"no checkpoint step kept by both {sorted(runs.values())}: "
                         "run make bench-quality first.")
    settings = {name: load_config(path).train for name, path in DRAFTERS}
    points = []
    for step in steps:
        taus = {name: score(storage.join(ckpt.checkpoints_url(runs[name]), ckpt.step_name(step)),
                            settings[name], validation) for name, _ in DRAFTERS}
        point = {"steps": step, **taus, "ratio": taus["dspark"] / taus["dflash"]}
        points.append(point)
        print(f"bench-quality-curve steps={step} dflash={taus['dflash']:.4f} dspark={taus['dspark']:.4f} "
              f"ratio={point['ratio']:.4f}", flush=True)
    live = live_ratio(root)
    print(f"bench-quality live macro ratio at {steps[-1]} steps: {live:.4f}" if live else
          "bench-quality live ratio: no bench_quality.json yet")
    (root / "bench_quality_curve.json").write_text(json.dumps(
        {"points": points, "live_ratio_last": live, "validation_samples": len(validation)}, indent=2) + "\n")
    plot(points, root / "bench_quality_curve.png")


if __name__ == "__main__":
    main()
