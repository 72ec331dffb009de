"""Open-PerfectBlend scale (issue 27): seconds and peak memory of each stage at two or more sizes.

    .venv/bin/python -m benchmarks.bench_scale                      # = make bench-scale
    .venv/bin/python -m benchmarks.bench_scale --stages prepare --prepare-rows 100000,1420909

Each measured stage runs as its own process (the `dspark` CLI, or the trainer for start-up); its
peak RSS is that process's own `ru_maxrss` (os.wait4), so one stage's memory never hides another's.
One line per stage and size, so growth shows:

    bench-scale STAGE n=N seconds=S peak_rss_mb=M [more=…]

- prepare: a generated JSONL shaped like mlabonne/open-perfectblend (ShareGPT `conversations`,
  1-3 human/gpt exchanges, 5-200 words a turn, a `source` column) through `dspark data prepare`.
- regen: `dspark data regen` of short prompts against the project's fixture OpenAI server on
  127.0.0.1 (no reply delay). At the largest size the run is `kill -9`ed once about half of the
  prompts are committed, then rerun; every prompt must then be in the output exactly once.
- cache-build / train-start: a cache of short conversations from a narrow random target (Llama
  layout, hidden 64, 2 layers, SmolLM2's tokenizer and vocabulary), then `train` until its first
  optimizer step (the process exits there: start-up seconds and memory).
Generated files live under --work and are deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is that for it as with was on be by this are or an from at which not have "
         "but one all can has their more if will about there would what so when up out into time "
         "only some could them than other then its also two how our first well way even new want "
         "because any these give day most us model data train value function return number list "
         "string error step answer question explain write code python example result first second "
         "third sum product prime proof theorem equation graph vector matrix gradient loss").split()
SMOLLM2 = ROOT / "runs" / "models" / "smollm2-135m-instruct"


def line(stage: str, n: int, seconds: float, peak_mb: float, **more: object) -> None:
    extra = "".join(f" {k}={v}" for k, v in more.items())
    print(f"bench-scale {stage} n={n} seconds={seconds:.1f} peak_rss_mb={peak_mb:.0f}{extra}", flush=True)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "TOKENIZERS_PARALLELISM": "false"}


def _wait(proc: subprocess.Popen) -> tuple[int, float]:
    """(exit status, peak RSS in MB) of a child: its own ru_maxrss, from wait4."""
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024


def measure(args: list[str], log: Path) -> tuple[float, float]:
    """Run a command to its end; (seconds, peak RSS MB). A failure stops the benchmark, log shown."""
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(args, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT)
        rc, peak = _wait(proc)
    seconds = time.perf_counter() - start
    if rc != 0:
        sys.exit(f"bench-scale: {' '.join(args[:6])} … failed ({rc}):\n{log.read_text()[-3000:]}")
    return seconds, peak


def dspark(*args: str) -> list[str]:
    return [sys.executable, "-m", "dspark_cli.cli", *args]


# ----------------------------------------------------------------------------------------- prepare

def blend_row(rng: random.Random, pool: list[str], i: int) -> dict:
    """One row shaped like Open-PerfectBlend: ShareGPT turns and a `source` column (words are
    slices of a random pool: generating 1.4M rows takes about a minute)."""
    turns = []
    for _ in range(rng.randint(1, 3)):
        for who in ("human", "gpt"):
            n = rng.randint(5, 200)
            start = rng.randrange(len(pool) - n)
            text = " ".join(pool[start:start + n])
            if who == "human" and not turns:
                text = f"q{i} {text}"  # distinct prompts (the real data set has few exact duplicates)
            turns.append({"from": who, "value": text})
    return {"conversations": turns, "source": ("gsm8k", "airoboros", "slimorca", "metamath")[i % 4]}


def write_blend(paths: dict[int, Path], seed: int = 0) -> float:
    """Write the sizes' files in one pass (each a prefix of the largest); seconds taken."""
    start = time.perf_counter()
    rng = random.Random(seed)
    pool = [rng.choice(WORDS) for _ in range(1 << 16)]
    handles = {n: p.open("w") for n, p in paths.items()}
    try:
        for i in range(max(paths)):
            text = json.dumps(blend_row(rng, pool, i)) + "\n"
            for n, f in handles.items():
                if i < n:
                    f.write(text)
    finally:
        for f in handles.values():
            f.close()
    return time.perf_counter() - start


def bench_prepare(work: Path, sizes: list[int], keep: bool) -> None:
    paths = {n: work / f"blend-{n}.jsonl" for n in sizes}
    if not all(p.exists() for p in paths.values()):
        took = write_blend(paths)
        size_gb = paths[max(sizes)].stat().st_size / 1e9
        print(f"prepare: generated {max(sizes)} rows ({size_gb:.2f} GB JSONL) in {took:.0f} s", flush=True)
    for n in sizes:
        out = work / f"prompts-{n}"
        shutil.rmtree(out, ignore_errors=True)
        seconds, peak = measure(dspark("data", "prepare", "--source", str(paths[n]), "--output", str(out)),
                                work / f"prepare-{n}.log")
        counts = json.loads((out / "manifest.json").read_text())["counts"]
        line("prepare", n, seconds, peak, rows=counts["rows"], quarantined=counts["quarantined"],
             us_per_row=round(1e6 * seconds / n))
        if not keep:
            shutil.rmtree(out)
    if not keep:
        for p in paths.values():
            p.unlink()


# ------------------------------------------------------------------------------------------- regen

def _prompts(work: Path, n: int) -> Path:
    """A prepared prompts artifact of n short, distinct prompts (not measured)."""
    out = work / f"regen-prompts-{n}"
    if (out / "manifest.json").exists():
        return out
    src = work / f"regen-prompts-{n}.jsonl"
    with src.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "messages": [
                {"role": "user", "content": f"Question {i}: what is {i} plus {i * 7}?"}]}) + "\n")
    measure(dspark("data", "prepare", "--source", str(src), "--output", str(out), "--val-fraction", "0.0"),
            work / f"regen-prepare-{n}.log")
    src.unlink()
    return out


def _committed_rows(out: Path) -> int:
    """Rows in the committed response shards, from the Parquet footers."""
    import pyarrow.parquet as pq

    total = 0
    for p in (out / "data").glob("part-*.parquet"):
        try:
            total += pq.ParquetFile(p).metadata.num_rows
        except OSError:
            pass  # renamed or removed under us
    return total


def _check_once(prompts: Path, out: Path) -> None:
    """Every prompt answered exactly once, read from the output itself."""
    import pyarrow.parquet as pq

    want = [i for p in sorted((prompts / "data").glob("part-*.parquet"))
            for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()]
    got = [i for p in sorted((out / "data").glob("part-*.parquet"))
           for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()]
    dupes = len(got) - len(set(got))
    missing = set(want) - set(got)
    if dupes or missing or len(got) != len(want):
        sys.exit(f"bench-scale regen: {len(got)} responses for {len(want)} prompts, {dupes} duplicated, "
                 f"{len(missing)} missing")
    print(f"regen: {len(got)} responses for {len(want)} prompts: each exactly once", flush=True)


def bench_regen(work: Path, sizes: list[int], keep: bool, concurrency: int) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.openai_server import start_openai_server

    with start_openai_server(model="bench-model") as server:
        for n in sizes:
            prompts = _prompts(work, n)
            out = work / f"responses-{n}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = dspark("data", "regen", "--input", str(prompts), "--output", str(out),
                         "--endpoint", server.url, "--model", "bench-model",
                         "--concurrency", str(concurrency),
                         "--max-tokens", "24", "--keep-truncated", "--batch-rows", "512")
            if n != max(sizes):
                seconds, peak = measure(cmd, work / f"regen-{n}.log")
                _check_once(prompts, out)
                line("regen", n, seconds, peak)
            else:  # kill -9 half way, then the rerun completes it
                start = time.perf_counter()
                with (work / f"regen-{n}-killed.log").open("w") as f:
                    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT)
                    while _committed_rows(out) < n // 2 and proc.poll() is None:
                        time.sleep(0.5)
                    os.kill(proc.pid, signal.SIGKILL)
                    _rc, peak1 = _wait(proc)
                first = time.perf_counter() - start
                killed_at = _committed_rows(out)
                if killed_at >= n:
                    sys.exit("bench-scale regen: the run finished before the kill")
                second, peak2 = measure(cmd, work / f"regen-{n}-rerun.log")
                _check_once(prompts, out)
                line("regen", n, first + second, max(peak1, peak2), killed_after=killed_at,
                     killed_run_s=round(first, 1), killed_run_peak_mb=round(peak1),
                     rerun_s=round(second, 1), rerun_peak_mb=round(peak2))
            if not keep:
                shutil.rmtree(out)
                shutil.rmtree(prompts)


# ------------------------------------------------------------------------------ cache + train start

def build_target(out: Path) -> Path:
    """A narrow random Llama-layout target with SmolLM2's tokenizer (hidden 64, 2 layers)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if not (SMOLLM2 / "tokenizer.json").exists():
        sys.exit(f"bench-scale: {SMOLLM2} is missing; run `make demo-model` first.")
    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def write_responses(out: Path, n: int, rows_per_shard: int = 10000) -> Path:
    """A responses artifact (contract 2) of n short conversations, written with the data stage's writer."""
    from dspark_cli.data.io import RESPONSE_SCHEMA, shard_name, write_table

    if (out / "data").exists():
        return out
    rng = random.Random(n)
    for k in range(0, n, rows_per_shard):
        rows = []
        for i in range(k, min(n, k + rows_per_shard)):
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 32)))
            rows.append({"id": f"r{i}", "source": "bench", "split": "validation" if i % 50 == 0 else "train",
                         "messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i * 7}?"},
                                      {"role": "assistant", "content": answer}],
                         "reasoning": [None], "thinking": False, "model": "bench", "endpoint": "local",
                         "sampling": "{}", "finish_reasons": ["stop"], "prompt_tokens": 0,
                         "completion_tokens": 0})
        write_table(str(out / "data" / shard_name(k // rows_per_shard)), rows, RESPONSE_SCHEMA)
    return out


TRAIN_SETS = ["target.mask_token_id=16", "model.num_draft_layers=1", "train.global_batch=8",
              "train.micro_batch=8", "train.num_anchors=16", "train.eval_samples=0", "train.precision=fp32"]


def train_child(cache: str, output: str, target: str) -> None:
    """Run `train` on the cache until its first optimizer step, then exit at once (start-up only)."""
    from dspark_cli.cache.reader import CacheDataset
    from dspark_cli.config import load_config
    from dspark_cli.train.trainer import train

    cfg = load_config(None, [f"target.model={target}", *TRAIN_SETS])

    def first_step(step: int, record: dict) -> None:
        print(f"first optimizer step done: loss {record.get('loss')}", flush=True)
        os._exit(0)

    train(cfg, cache, output, force=True, open_split=lambda split: CacheDataset(cache, split=split),
          on_step_end=first_step)
    sys.exit("train ended without an optimizer step")


def bench_cache_train(work: Path, sizes: list[int], keep: bool) -> None:
    target = build_target(work / "target")
    for n in sizes:
        responses = write_responses(work / f"cache-responses-{n}", n)
        cache = work / f"cache-{n}"
        if not (cache / "manifest.json").exists():
            build = dspark("cache", "build", "--responses", str(responses), "--output", str(cache),
                           "--target", str(target), "--layers", "0,1", "--dtype", "float32",
                           "--device", "cpu",
                           "--samples-per-shard", "1024", "--batch-tokens", "16384", "--min-loss-tokens", "8",
                           "--max-length", "256")
            seconds, peak = measure(build, work / f"cache-build-{n}.log")
            counts = json.loads((cache / "manifest.json").read_text())["counts"]
            size_mb = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) / 2**20
            line("cache-build", n, seconds, peak, samples=counts.get("samples"), tokens=counts.get("tokens"),
                 disk_mb=round(size_mb))
        seconds, peak = measure([sys.executable, "-m", "benchmarks.bench_scale", "--train-child", str(cache),
                                 str(work / f"train-{n}"), str(target)], work / f"train-{n}.log")
        line("train-start", n, seconds, peak)
        if not keep:
            for p in (responses, cache, work / f"train-{n}"):
                shutil.rmtree(p, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="prepare,regen,train",
                        help="prepare, regen, train (cache + start-up)")
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench-scale"))
    parser.add_argument("--prepare-rows", default="100000,400000,1420909")
    parser.add_argument("--regen-prompts", default="20000,200000")
    parser.add_argument("--regen-concurrency", type=int, default=64)
    parser.add_argument("--cache-samples", default="20000,100000")
    parser.add_argument("--keep", action="store_true", help="keep the generated files and outputs")
    parser.add_argument("--train-child", nargs=3, metavar=("CACHE", "OUTPUT", "TARGET"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_child:
        train_child(*args.train_child)
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    stages = {s.strip() for s in args.stages.split(",")}
    sizes = {name: sorted(int(x) for x in getattr(args, name).split(","))
             for name in ("prepare_rows", "regen_prompts", "cache_samples")}
    print(f"bench-scale: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, work {work}", flush=True)
    if "prepare" in stages:
        bench_prepare(work, sizes["prepare_rows"], args.keep)
    if "regen" in stages:
        bench_regen(work, sizes["regen_prompts"], args.keep, args.regen_concurrency)
    if "train" in stages:
        bench_cache_train(work, sizes["cache_samples"], args.keep)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"bench-scale: done (the benchmark's own process peaked at {own:.0f} MB)")


if __name__ == "__main__":
    main()
