"""`make bench-online`: training online (the target in the loop) against training from a cache.

    .venv/bin/python -m benchmarks.bench_online                       # the demo's responses, 60 steps
    .venv/bin/python -m benchmarks.bench_online --work-dir runs/bench-online-short --limit 24 \\
        --max-tokens 48 --steps 3 --eval-samples 4                     # a short check that it runs

On SmolLM2-135M-Instruct and the demo's regenerated responses (`runs/smollm2-135m-dspark/responses`
after `make demo`; whatever is missing — the converted model, the responses, the cache — is built
first, with the demo's own config). Then the same drafter is trained twice from the same seed for
the same number of steps, each in a fresh process (so its peak RSS is its own): once from the
cache, once `--online`. Reported: seconds per step (mean over the steps after the first) with
the target's and the drafter's share, peak memory, the two drafters' held-out τ (train's
validation score on the same samples: they must agree within noise), and the break-even — how
many epochs of online training cost as much time as building the cache once:

    break-even epochs = cache build seconds / ((online s/step − cached s/step) × steps per epoch)

Figures from a machine shared with other work are labelled as contended (--contended).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "pipelines" / "smollm2-135m.toml"
MODEL = "runs/models/smollm2-135m-instruct"


def dspark(*args: str) -> None:
    cmd = [sys.executable, "-m", "dspark_cli.cli", *args]
    print("$ dspark " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def sets(args: argparse.Namespace) -> list[str]:
    """The demo config's overrides for this benchmark (work dir, data volume, training budget)."""
    out = [f"pipeline.work_dir={args.work_dir}", f"train.max_steps={args.steps}",
           f"train.save_every={args.steps}", "train.log_every=1", f"train.eval_samples={args.eval_samples}",
           f"train.device={args.device}", f"target.device={args.device}",
           "model.draft_vocab_size=0"]  # the demo's reduced vocabulary is counted from a cache
    if args.limit:
        out += [f"data.limit={args.limit}"]
    if args.max_tokens:
        out += [f"regen.max_tokens={args.max_tokens}"]
    return out


def prepare(args: argparse.Namespace) -> dict:
    """Build what is missing: the model, the responses (demo stages prepare + regen), the cache."""
    work = ROOT / args.work_dir
    if not (ROOT / MODEL / "config.json").exists():
        dspark("model", "convert", "--smollm2", MODEL)
    over = [a for s in sets(args) for a in ("--set", s)]
    if not (work / "responses" / "manifest.json").exists():
        dspark("pipeline", "run", str(CONFIG), "--stages", "prepare,regen", *over)
    built_now = not (work / "cache" / "manifest.json").exists()
    started = time.time()
    dspark("cache", "build", "--config", str(CONFIG), *over)
    manifest = json.loads((work / "cache" / "manifest.json").read_text())
    build_s = time.time() - started if built_now else manifest["timings"]["wall_seconds"]
    return {"cache_build_s": round(build_s, 1), "cache_bytes": manifest["extra"]["bytes"],
            "cache_samples": manifest["counts"]["samples"], "cache_built_now": built_now}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KB


def child(args: argparse.Namespace) -> None:
    """Train once (`--mode cache|online`) and print one JSON line of figures."""
    import torch

    torch.set_num_threads(args.threads)
    from dspark_cli.cache.reader import CacheDataset
    from dspark_cli.config import load_config
    from dspark_cli.train.online import OnlineSource
    from dspark_cli.train.trainer import train

    work = ROOT / args.work_dir
    out = work / f"bench-online-{args.mode}"
    cfg = load_config(str(CONFIG), [*sets(args), f"train.source={args.mode}"])
    if args.mode == "online":
        url = str(work / "responses")
        open_split = OnlineSource(cfg, url).open
    else:
        url = str(work / "cache")

        def open_split(split: str) -> CacheDataset:
            return CacheDataset(url, split=split)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    manifest = train(cfg, url, str(out), force=True, open_split=open_split).manifest
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    times = ([b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:], strict=False)]
             or [rows[0]["elapsed_s"]])
    result = {
        "mode": args.mode, "steps": len(rows), "s_per_step": sum(times) / len(times),
        "target_s_per_step": sum(r.get("target_s", 0.0) for r in steady) / len(steady),
        "drafter_s_per_step": sum(r["drafter_s"] for r in steady) / len(steady),
        "wait_s_per_step": sum(r["data_wait_s"] for r in steady) / len(steady),
        "peak_rss_mb": round(rss_mb()), "final_loss": rows[-1]["loss"],
        "train_samples": manifest["counts"]["train_samples"],
        "tau_validation": (manifest["extra"].get("validation") or {}).get("accepted_length"),
        "validation_loss": (manifest["extra"].get("validation") or {}).get("loss"),
    }
    if torch.cuda.is_available():
        result["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20)
    print("RESULT " + json.dumps(result), flush=True)


def run_child(args: argparse.Namespace, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--mode", mode, *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"bench-online: the {mode} run failed (exit {done.returncode}).")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default="runs/smollm2-135m-dspark")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--limit", type=int, default=0, help="prompts to regenerate if responses are missing")
    parser.add_argument("--max-tokens", type=int, default=0, help="regen.max_tokens when regenerating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--contended", action="store_true", help="label the figures as from a shared machine")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from dspark_cli.config import load_config

    built = prepare(args)
    cached, online = run_child(args, "cache"), run_child(args, "online")
    global_batch = load_config(str(CONFIG), sets(args)).train.global_batch
    steps_per_epoch = max(1, cached["train_samples"] // global_batch)
    extra = online["s_per_step"] - cached["s_per_step"]
    epochs = built["cache_build_s"] / (extra * steps_per_epoch) if extra > 0 else None
    report = {
        "machine": "contended (shared CPU cores)" if args.contended else "dedicated",
        "work_dir": args.work_dir, "steps": args.steps, **built, "steps_per_epoch": steps_per_epoch,
        "cache": cached, "online": online,
        "tau_difference": (None if cached["tau_validation"] is None else
                           round(online["tau_validation"] - cached["tau_validation"], 4)),
        "online_extra_s_per_epoch": round(extra * steps_per_epoch, 1),
        "break_even_epochs": None if epochs is None else round(epochs, 2),
    }
    print(json.dumps(report, indent=2))
    label = " [CONTENDED machine: timings are indicative only]" if args.contended else ""
    print(f"\nbench-online{label}")
    for r in (cached, online):
        print(f"  {r['mode']:>6}: {r['s_per_step']:.2f} s/step (target {r['target_s_per_step']:.2f}, "
              f"drafter {r['drafter_s_per_step']:.2f}, wait {r['wait_s_per_step']:.2f}), "
              f"peak RSS {r['peak_rss_mb']} MB, τ(val) {r['tau_validation']:.4f}")
    print(f"  cache: {built['cache_bytes'] / 2**20:.1f} MB, built in {built['cache_build_s']:.0f} s; "
          + (f"it pays for itself after {epochs:.2f} epochs" if epochs is not None else
             "online is no slower per step here: the cache never pays for itself in time"))


if __name__ == "__main__":
    main()
