"""Decode-speed benchmark (issue 16, docs/eval.md): where a speculative round's time goes on the
demo's target and drafter, whether the loop beats the target alone, and the paper's Figure 8
(throughput and verified tokens per request vs R for each schedule) measured, not modelled.

    make bench-decode                 # builds the demo drafter first if it is missing
    python benchmarks/bench_decode.py --limit 4 --max-new-tokens 64 --repeats 2
    python benchmarks/bench_decode.py --skip-figure8 --top-k 0      # the whole-vocabulary Markov step

Per dataset it prints t₁…t₈ (one target step over n tokens), t_draft split into backbone + lm_head
+ top-k and the sequential head loop (and the new context rows), t_verify, c = t_draft / t_verify,
the time outside both, τ, speculative and target-only tokens/s, the speed-up and the one the cost
model predicts, τ·t₁ / (t_draft + t_verify + t_prefill) — with t₁ the target-only loop's seconds per
token on the same prompts and t_prefill the speculative side's prompt prefills per round: t₁
includes the baseline's own prefill, so the round is charged its own (without it the prediction
read 9-11% high on 4 × 64 tokens; docs/benchmarks.md#make-bench-decode). The prediction with the
micro benchmark's t₁ is printed for reference. Then one line per dataset for scripts. It decodes
with the demo's `[eval]` schedule (`--schedule`, `--threshold`), so its speed-up compares with the
demo's report:

    bench-decode gsm8k tau=1.25 c=0.21 speedup=1.02 predicted=1.03

Timings are wall-clock on whatever else the machine runs: say whether it was idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dspark_cli.config import load_config
from dspark_cli.decode.batch import TargetBatch
from dspark_cli.decode.prompts import dataset_name, load_conversations
from dspark_cli.decode.report import round_phases
from dspark_cli.decode.scheduler import POLICIES, Scheduler
from dspark_cli.decode.specdec import SpeculativeDecoder, Stopwatch, paired_decode, target_only, warm_up
from dspark_cli.decode.sps import profile_target
from dspark_cli.decode.stages import load_calibration
from dspark_cli.model.block_sampler import compile_wanted
from dspark_cli.model.export import load_drafter
from dspark_cli.target.chat import render_prompt
from dspark_cli.target.dtypes import auto_dtype
from dspark_cli.target.dtypes import torch_dtype as resolve_dtype
from dspark_cli.target.model import load_target
from dspark_cli.target.prepack import prepack_linears

DEMO = "runs/smollm2-135m-dspark"
#: What the demo's eval decodes with, so the decoding table compares with its report.
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "pipelines" / "smollm2-135m.toml"
DATASETS = ["dspark_cli/resources/demo_eval_gsm8k.jsonl", "dspark_cli/resources/demo_eval_humaneval.jsonl"]


def median_time(fn, repeats: int = 8, warmup: int = 2) -> float:
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_times(model, prompt: list[int], sizes: list[int]) -> dict[int, float]:
    """t_n: one target forward + lm_head over n new tokens after the prompt (the decoder's call)."""
    batch = TargetBatch(model, [0])
    batch.add(prompt)
    lm_head = model.get_output_embeddings()

    def step(n: int) -> None:
        _h, final = batch.forward([prompt[-n:]], [len(prompt)])
        lm_head(final)
        batch.commit([0])

    return {n: median_time(lambda n=n: step(n)) for n in sizes}


def draft_times(drafter, model, prompt: list[int], temperature: float, top_k: int) -> dict[str, float]:
    """Median seconds of a draft round's phases on one request whose context is `prompt`."""
    from dspark_cli.target.capture import capture_layers

    hidden, _final = capture_layers(model, prompt, list(drafter.config.target_layer_ids))
    context = drafter.new_context()
    context.add_row()
    drafter.extend_context(context, [hidden[:-1].to(torch.bfloat16)])
    anchor = torch.tensor([prompt[-1]])
    gen = torch.Generator().manual_seed(0)
    laps: dict[str, list[float]] = {"draft_backbone": [], "draft_heads": []}
    for i in range(10):
        phases: dict[str, float] = {}
        watch = Stopwatch(next(drafter.parameters()).device, phases)
        drafter.draft(context, anchor, temperature, gen, top_k, lap=watch.lap)
        if i >= 2:
            for k in laps:
                laps[k].append(phases[k])
    return {k: statistics.median(v) for k, v in laps.items()}


def micro(args, model, drafter, prompt: list[int]) -> dict:
    """t₁…t₈ and the draft round (both Markov variants) in this dtype: the cost model's inputs."""
    steps = step_times(model, prompt, [1, 2, 4, 8])
    out = {"t": steps, "draft": {}}
    for k in sorted({args.top_k, 0}):
        out["draft"][k] = draft_times(drafter, model, prompt, args.temperature, k)
    return out


def decode_dataset(args, model, tok, drafter, convs, temps, schedule=None, concurrency=1,
                   sps=None, max_new_tokens=None):
    """One decode of `convs`; the schedule defaults to --schedule (the demo's eval schedule)."""
    scheduler = Scheduler(schedule or args.schedule, drafter.block_size if drafter is not None else 1, sps,
                          threshold=args.threshold)
    decoder = SpeculativeDecoder(model, tok, drafter, scheduler, temperature=args.temperature,
                                 max_new_tokens=max_new_tokens or args.max_new_tokens,
                                 temperatures=temps if drafter is not None else None,
                                 seed=args.seed, draft_top_k=args.top_k)
    return decoder.run(convs, concurrency)


def round_costs(stats) -> dict[str, float]:
    """Per-round means of the loop's own phases (seconds) and τ."""
    rounds = max(len(stats.batches), 1)
    ph = round_phases(stats)
    return {"rounds": len(stats.batches), "tau": sum(b.emitted for b in stats.batches) / rounds,
            "draft_backbone": ph["draft_backbone"], "draft_heads": ph["draft_heads"],
            "draft_context": ph["draft_context"], "t_draft": ph["draft"], "t_verify": ph["verify"],
            "outside": ph["outside"], "t_prefill": ph["prefill"], "prefill_s": stats.phases.get("prefill", 0),
            "tokens_per_second": stats.new_tokens / stats.seconds}


def ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def bench_datasets(args, model, tok, drafter, temps, t1: float) -> list[dict]:
    results = []
    for url in args.dataset:
        name = dataset_name(url)
        convs = load_conversations(url, args.limit)
        def decode_few(few, tokens):
            return decode_dataset(args, model, tok, drafter, few, temps, max_new_tokens=tokens)

        warm_up(decode_few, model, tok, convs, baseline=True, temperature=args.temperature,
                thinking=False, seed=args.seed)
        runs = []
        for rep in range(args.repeats):
            spec, base = paired_decode(
                lambda few: decode_dataset(args, model, tok, drafter, few, temps),
                lambda few: target_only(model, tok, few, temperature=args.temperature,
                                        max_new_tokens=args.max_new_tokens, thinking=False, seed=args.seed),
                convs)
            cost = round_costs(spec)
            cost["target_only_tokens_per_second"] = base.new_tokens / base.seconds
            cost["speedup"] = cost["tokens_per_second"] / cost["target_only_tokens_per_second"]
            cost["c"] = cost["t_draft"] / cost["t_verify"]
            # t₁ as the target-only loop paid it on these prompts, its prefills included (its
            # contexts grow past the micro benchmark's prompt); the round pays its own prefills, so
            # the prediction misses only the overhead outside the timed phases.
            cost["t1_loop"] = base.seconds / base.new_tokens
            round_seconds = cost["t_draft"] + cost["t_verify"] + cost["t_prefill"]
            cost["predicted"] = cost["tau"] * cost["t1_loop"] / round_seconds
            cost["predicted_micro_t1"] = cost["tau"] * t1 / (cost["t_draft"] + cost["t_verify"])
            cost["verify_over_t1"] = cost["t_verify"] / cost["t1_loop"]
            runs.append(cost)
            print(f"  {name} run {rep + 1}: τ {cost['tau']:.2f}, {cost['tokens_per_second']:.1f} tok/s spec, "
                  f"{cost['target_only_tokens_per_second']:.1f} tok/s target, speed-up {cost['speedup']:.2f}",
                  flush=True)
        results.append({"name": name, "conversations": len(convs), "runs": runs})
    return results


def print_datasets(results: list[dict], t: dict[int, float]) -> None:
    print("\n## per dataset (means over rounds; runs separated by /)")
    cols = ["t₁ ms", "t₂", "t₄", "t₈", "t₁ in loop", "t_verify / t₁ in loop",
            "draft backbone+lm_head ms", "draft head loop", "draft context",
            "t_draft", "t_verify", "c", "t_prefill", "outside", "τ", "spec tok/s", "target tok/s", "speed-up",
            "predicted", "predicted (micro t₁)"]
    print("| dataset | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for d in results:
        def all_runs(key, fmt, runs=d["runs"]):
            return " / ".join(fmt(r[key]) for r in runs)

        cells = [ms(t[1]), ms(t[2]), ms(t[4]), ms(t[8]), all_runs("t1_loop", ms),
                 all_runs("verify_over_t1", "{:.2f}".format),
                 all_runs("draft_backbone", ms), all_runs("draft_heads", ms), all_runs("draft_context", ms),
                 all_runs("t_draft", ms), all_runs("t_verify", ms), all_runs("c", "{:.2f}".format),
                 all_runs("t_prefill", ms), all_runs("outside", ms), all_runs("tau", "{:.2f}".format),
                 all_runs("tokens_per_second", "{:.1f}".format),
                 all_runs("target_only_tokens_per_second", "{:.1f}".format),
                 all_runs("speedup", "{:.2f}".format), all_runs("predicted", "{:.2f}".format),
                 all_runs("predicted_micro_t1", "{:.2f}".format)]
        print(f"| {d['name']} | " + " | ".join(cells) + " |")


def bench_figure8(args, model, tok, drafter, temps) -> dict:
    """Measured throughput and verified tokens per request vs R, per schedule (paper Fig. 8), and
    the target alone batched by the same loop (one token per request per step) as the baseline."""
    gamma = drafter.block_size
    grid = sorted({1, 2, 4, 8, 16, 32, 64, 128} | {r * (gamma + 1) for r in args.figure8_r})
    t0 = time.perf_counter()
    sps = profile_target(model, grid, context_length=192, repeats=3, tokens_per_row=gamma + 1)
    print(f"\n## SPS(B) with the batched verification forward ({time.perf_counter() - t0:.0f} s; "
          f"rows of {gamma + 1} tokens, context 192)")
    print("| B | rows | steps/s | tokens/s |")
    print("|---|---|---|---|")
    for b, s in zip(sps.batch_tokens, sps.steps_per_second, strict=True):
        print(f"| {b} | {-(-b // (gamma + 1))} | {s:.2f} | {b * s:.0f} |")
    convs = load_conversations(args.dataset[0], args.figure8_limit)
    rows = []
    print(f"\n## Figure 8, measured: {dataset_name(args.dataset[0])}, {len(convs)} conversations, "
          f"{args.figure8_tokens} new tokens each, T={args.temperature}")
    print("| schedule | R | tok/s measured | Θ modelled | τ/request | verified/request/round | rounds |")
    print("|---|---|---|---|---|---|---|")
    for policy in [*args.policies, "target alone"]:
        for r in args.figure8_r:
            stats = decode_dataset(args, model, tok, None if policy == "target alone" else drafter, convs,
                                   temps, "fixed" if policy == "target alone" else policy, r, sps,
                                   args.figure8_tokens)
            b = stats.batches
            n = max(len(b), 1)
            req_rounds = sum(x.requests for x in b) or 1
            row = {"schedule": policy, "R": r, "tokens_per_second": stats.new_tokens / stats.seconds,
                   "theta": sum(x.theta for x in b) / n,
                   "tau_per_request": sum(x.emitted for x in b) / req_rounds,
                   "verified_per_request": sum(x.batch_tokens - x.requests for x in b) / req_rounds,
                   "rounds": len(b)}
            rows.append(row)
            print(f"| {policy} | {r} | {row['tokens_per_second']:.1f} | {row['theta']:.1f} | "
                  f"{row['tau_per_request']:.2f} | {row['verified_per_request']:.2f} | {row['rounds']} |",
                  flush=True)
    return {"sps": sps.to_dict(), "rows": rows}


def main() -> None:
    demo_eval = load_config(str(DEMO_CONFIG), []).eval  # the schedule the demo's report decodes with
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="runs/models/smollm2-135m-instruct")
    ap.add_argument("--drafter", default=f"{DEMO}/train")
    ap.add_argument("--calibration", default=f"{DEMO}/calibration/calibration.json",
                    help="STS for threshold/algorithm1/async (skipped when the file is missing).")
    ap.add_argument("--dataset", action="append", default=None)
    ap.add_argument("--limit", type=int, default=4, help="conversations per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="auto",
                    help="target and drafter dtype (auto: bfloat16 where the CPU has it natively)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=64, help="drafter candidates for the Markov bias (0: all)")
    ap.add_argument("--repeats", type=int, default=2, help="decodes per dataset, to show the spread")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-prepack", dest="prepack", action="store_false",
                    help="the target's plain linears ([target] prepack = false), for comparison")
    ap.add_argument("--schedule", default=demo_eval.schedule, choices=POLICIES,
                    help="the decoding table's schedule (default: the demo's [eval] schedule)")
    ap.add_argument("--threshold", type=float, default=demo_eval.threshold,
                    help="the threshold schedule's cut (default: the demo's)")
    ap.add_argument("--figure8-r", default="1,4,8,16")
    ap.add_argument("--figure8-limit", type=int, default=16)
    ap.add_argument("--figure8-tokens", type=int, default=32)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--skip-figure8", action="store_true")
    ap.add_argument("--out", default="runs/bench-decode/results.json")
    args = ap.parse_args()
    args.dataset = args.dataset or DATASETS
    args.figure8_r = [int(x) for x in args.figure8_r.split(",")]
    args.policies = [p for p in args.policies.split(",") if p]
    torch.set_num_threads(args.threads)
    args.dtype = auto_dtype(args.dtype, "cpu")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    t_start = time.perf_counter()
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"# bench-decode {started}: {args.target} + {args.drafter}, {args.dtype}, {args.threads} threads, "
          f"T={args.temperature}, top-k {args.top_k}, prepack {args.prepack}; load average {' '.join(load)}")

    model, tok = load_target(args.target, dtype=args.dtype, device="cpu", prepack=args.prepack)
    drafter = load_drafter(args.drafter, target=args.target, dtype=resolve_dtype(args.dtype))
    if args.prepack:  # as `dspark eval` loads them (decode/stages.py load_models)
        prepack_linears(drafter)
    drafter.compile_sampler(compile_wanted("auto", torch.device("cpu")))  # as eval's target.compile_draft
    temps = None
    if Path(args.calibration).exists():
        temps = load_calibration(args.calibration, drafter.block_size)
    conv = load_conversations(args.dataset[0], 1)[0]
    prompt = render_prompt(tok, [{"role": "user", "content": conv.turns[0]}], thinking=False)

    print(f"\n## one round's parts (medians of 8; prompt of {len(prompt)} tokens as context)")
    print("| dtype | t₁ ms | t₂ | t₄ | t₈ | draft backbone+lm_head+top-k (top-k) | head loop (top-k) | "
          "backbone (all V) | head loop (all V) |")
    print("|---|---|---|---|---|---|---|---|---|")
    micros = {}
    for dtype in dict.fromkeys([args.dtype, "float32"]):
        m, d = model, drafter
        if dtype != args.dtype:
            m, _ = load_target(args.target, dtype=dtype, device="cpu", prepack=args.prepack)
            d = load_drafter(args.drafter, target=args.target, dtype=resolve_dtype(dtype))
            if args.prepack:
                prepack_linears(d)
            d.compile_sampler(compile_wanted("auto", torch.device("cpu")))
        micros[dtype] = res = micro(args, m, d, prompt)
        k = res["draft"][args.top_k]
        full = res["draft"][0]
        print(f"| {dtype} | {ms(res['t'][1])} | {ms(res['t'][2])} | {ms(res['t'][4])} | {ms(res['t'][8])} | "
              f"{ms(k['draft_backbone'])} | {ms(k['draft_heads'])} | {ms(full['draft_backbone'])} | "
              f"{ms(full['draft_heads'])} |", flush=True)
        del m, d
    t1 = micros[args.dtype]["t"][1]

    cut = f" {args.threshold}" if args.schedule == "threshold" else ""
    print(f"\n## decoding ({args.schedule} schedule{cut}, R = 1)")
    datasets = bench_datasets(args, model, tok, drafter, temps, t1)
    print_datasets(datasets, micros[args.dtype]["t"])
    figure8 = None if args.skip_figure8 else bench_figure8(args, model, tok, drafter, temps)
    elapsed = time.perf_counter() - t_start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"started": started, "seconds": elapsed, "args": vars(args),
                                          "micro": micros, "datasets": datasets, "figure8": figure8},
                                         indent=1, default=str))
    print(f"\nwall {elapsed:.0f} s; results {args.out}")
    for d in datasets:
        runs = d["runs"]

        def mean(key, runs=runs):
            return statistics.mean(r[key] for r in runs)

        print(f"bench-decode {d['name']} tau={mean('tau'):.2f} c={mean('c'):.2f} "
              f"speedup={mean('speedup'):.2f} predicted={mean('predicted'):.2f}")


if __name__ == "__main__":
    main()
