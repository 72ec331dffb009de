"""Eval-stage benchmark (docs/eval.md): audit p-values, STS on synthetic miscalibration, the SPS
table of a real target on this machine, and — when a trained drafter exists — τ, conditional
acceptance and tokens/s of real speculative decoding under each schedule.

    python -m benchmarks.bench_eval                       # audit + STS + SPS of SmolLM2-135M
    python -m benchmarks.bench_eval --drafter runs/smollm2-135m-dspark/train --limit 5
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from dspark_cli import storage
from dspark_cli.config import load_config
from dspark_cli.decode.audit import run_audit
from dspark_cli.decode.calibrate import RoundRecords, fit_sts, scale
from dspark_cli.decode.stages import run_eval, run_profile


def bench_audit(samples: int) -> list[dict]:
    t0 = time.perf_counter()
    rows = [r.to_dict() for r in run_audit(samples=samples)]
    print(f"\n## audit ({samples} outputs per policy, {time.perf_counter() - t0:.1f} s)")
    print("| world | policy | p-value | first token observed | target |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world']} | {r['policy']} | {r['p_value']:.3g} | {r['first_token_observed']} | "
              f"{r['first_token_target']} |")
    return rows


def bench_sts(n: int = 5000, gamma: int = 7, power: float = 2.5) -> dict:
    rng = np.random.default_rng(0)
    q = rng.uniform(0.3, 0.98, (n, gamma))
    ok = rng.random((n, gamma)) < q
    accepted = np.argmin(np.concatenate([ok, np.zeros((n, 1), bool)], 1), axis=1)
    rec = RoundRecords(scale(q, [1 / power] * gamma), np.full(n, gamma), accepted)
    t0 = time.perf_counter()
    fit = fit_sts(rec)
    out = {"rounds": n, "gamma": gamma, "true_temperature": power, "temperatures": fit.temperatures,
           "ece_before": fit.ece_before, "ece_after": fit.ece_after, "seconds": time.perf_counter() - t0}
    print(f"\n## STS on synthetic confidences overconfident by {power} ({n} rounds, γ={gamma})")
    print(f"ECE {fit.ece_before:.4f} → {fit.ece_after:.4f}; T = {[round(t, 2) for t in fit.temperatures]}; "
          f"fit {out['seconds']:.2f} s")
    return out


def bench_sps(target: str, out: str, dtype: str) -> dict:
    cfg = load_config(None, [f"target.dtype='{dtype}'", "target.device='cpu'"])
    url = f"{out}/profile-{Path(target).name}-{dtype}"
    table = run_profile(cfg, target, url, [1, 2, 4, 8, 16, 32, 64, 128], context_length=256,
                        repeats=3).summary
    print(f"\n## SPS(B) of {target} ({dtype}, {torch.get_num_threads()} threads)")
    print("| B | steps/s | tokens/s |")
    print("|---|---|---|")
    for b, s in zip(table["batch_tokens"], table["steps_per_second"], strict=True):
        print(f"| {b} | {s:.1f} | {b * s:.0f} |")
    return {"url": url, **table}


def bench_decode(target: str, drafter: str, dataset: str, limit: int, max_new: int, sps_url: str,
                 out: str, dtype: str) -> list[dict]:
    rows = []
    for schedule, concurrency, sweep in (("fixed", 1, []), ("algorithm1", 4, [1, 8]), ("async", 4, [])):
        cfg = load_config(None, [
            f"target.dtype='{dtype}'", "target.device='cpu'", f"eval.datasets=['{dataset}']",
            f"eval.limit={limit}", f"eval.max_new_tokens={max_new}", f"eval.schedule='{schedule}'",
            f"eval.concurrency={concurrency}", f"eval.concurrency_sweep={sweep}", f"eval.sps='{sps_url}'",
            f"eval.baseline={'true' if schedule == 'fixed' else 'false'}"])
        report = run_eval(cfg, target, drafter, f"{out}/eval-{schedule}-R{concurrency}", force=True).summary
        d = report["datasets"][0]
        keep = ("tau", "acceptance_rate", "rounds", "new_tokens")
        rows.append({"schedule": schedule, **{k: d[k] for k in keep},
                     "conditional": d["position_acceptance"]["conditional"],
                     "tokens_per_second": d["tokens_per_second"], "scheduler": d["scheduler"]})
    print(f"\n## speculative decoding, {dataset}, {limit} prompts, ≤{max_new} new tokens, T=1")
    print("| schedule | R | τ | tok/s spec | tok/s target | verified/round | budget/request | Θ |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tps = r["tokens_per_second"]
        for s in r["scheduler"]:
            print(f"| {r['schedule']} | {s['concurrency']} | {r['tau']:.2f} | "
                  f"{tps['speculative'] or 0:.1f} | {tps['target_only'] or 0:.1f} | "
                  f"{s['verified_per_round']:.1f} | "
                  f"{s['budget_per_request']:.2f} | {s['theta']:.1f} |")
    return rows


def self_distilled_drafter(target: str, out: str, prompts: int, steps: int, dtype: str,
                           max_new_tokens: int = 96) -> str:
    """No demo drafter yet: the target answers `prompts` bundled prompts itself (as regen would),
    `capture_layers` gives their features exactly as the cache stores them, the real trainer fits a
    1-layer drafter for `steps` steps. A quick stand-in for `make demo`, not a quality result."""
    from dspark_cli.decode.prompts import load_conversations
    from dspark_cli.decode.specdec import target_only
    from dspark_cli.target.capture import answer_sample
    from dspark_cli.target.chat import render_prompt
    from dspark_cli.target.model import load_target
    from dspark_cli.train.trainer import train

    layers, mask_id = [1, 8, 14, 20, 27], 16  # as pipelines/smollm2-135m.toml
    model, tokenizer = load_target(target, dtype=dtype, device="cpu")
    convs = load_conversations("dspark_cli/resources/demo_prompts.jsonl", limit=prompts)
    convs = [c.__class__(c.id, c.turns[:1], c.system) for c in convs]
    t0 = time.perf_counter()
    answers = target_only(model, tokenizer, convs, temperature=0.7, max_new_tokens=max_new_tokens,
                          thinking=False).answers
    samples = []
    for conv in convs:
        prompt = render_prompt(tokenizer, [{"role": "user", "content": conv.turns[0]}], thinking=False)
        answer = tokenizer(answers[conv.id][0], add_special_tokens=False)["input_ids"]
        samples.append(answer_sample(model, conv.id, prompt, answer, tokenizer.eos_token_id, layers))
    print(f"\n(self-distilled {len(samples)} answers in {time.perf_counter() - t0:.0f} s)")
    cfg = load_config(None, [
        f"target.model='{target}'", f"target.layers={layers}", f"target.mask_token_id={mask_id}",
        f"target.dtype='{dtype}'", "target.device='cpu'", "model.num_draft_layers=1", "model.block_size=7",
        "model.markov_rank=64", f"train.max_steps={steps}", "train.global_batch=4", "train.micro_batch=2",
        "train.num_anchors=24", "train.lr=1e-3", "train.device='cpu'", "train.save_every=100000",
        "train.log_every=20"])
    url = f"{out}/self-distilled-train"
    t0 = time.perf_counter()
    train(cfg, f"{out}/no-cache", url, dataset=samples)
    print(f"(trained {steps} steps in {time.perf_counter() - t0:.0f} s)")
    return url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="runs/models/smollm2-135m-instruct")
    ap.add_argument("--drafter", default=None,
                    help="Train artifact / export folder; decoding is skipped when absent.")
    ap.add_argument("--self-distill", type=int, default=0, metavar="N",
                    help="Without --drafter: train a stand-in drafter on N self-distilled answers.")
    ap.add_argument("--train-steps", type=int, default=60)
    ap.add_argument("--distill-tokens", type=int, default=96)
    ap.add_argument("--dataset", default="/work/shared/eval_datasets/gsm8k.jsonl")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--audit-samples", type=int, default=4000)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/eval-bench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {"audit": bench_audit(args.audit_samples), "sts": bench_sts()}
    if storage.exists(args.target):
        results["sps"] = bench_sps(args.target, args.out, args.dtype)
        drafter = args.drafter if args.drafter and storage.exists(args.drafter) else None
        if drafter is None and args.self_distill:
            drafter = self_distilled_drafter(args.target, args.out, args.self_distill, args.train_steps,
                                             args.dtype, args.distill_tokens)
        if drafter:
            results["decode"] = bench_decode(args.target, drafter, args.dataset, args.limit,
                                             args.max_new_tokens, f"{results['sps']['url']}/sps.json",
                                             args.out, args.dtype)
    else:
        print(f"\n(no target at {args.target}: run `make demo-model` for the SPS and decoding parts)")
    storage.write_json(f"{args.out}/bench_eval.json", results)
    print(f"\nresults: {args.out}/bench_eval.json")


if __name__ == "__main__":
    main()
