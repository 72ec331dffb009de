"""Training throughput of a SmolLM2-135M-sized drafter: train.fast_kernels on vs off, in one run.

    .venv/bin/python -m benchmarks.bench_train [--draft-layers 2] [--steps 5] [--threads 2]
        [--precision auto] [--paths fast,earlier] [--chunks 64] [--draft-vocabs 0,8192]

Shapes are SmolLM2-135M's (vocab 49152, hidden 576, 9 heads / 3 KV heads, head dim 64,
intermediate 1536, 30 target layers, tied embeddings); γ = 7 and 512 anchors per sample. The
target's embedding is random (only its shape matters for speed and memory), written as a
safetensors folder that holds just the embedding and config.json; the cached features are random
bf16 tensors of a 1024-token sample. Each setting runs in a fresh process, so its peak RSS
(ru_maxrss) is its own. Per setting: optimizer steps per second, and the FLOP/s achieved, its
FLOPs counted by FlopCounterMode on the warm-up step (matmuls; CPU SDPA is not counted), beside
the machine's peak: a 2048 × 2048 matmul in the step's precision, timed in the same run.
`--chunks 64,0` adds the unchunked loss (peak memory of chunking vs not). `--draft-vocabs 0,8192`
adds a reduced draft vocabulary (model.draft_vocab_size) to the fast path's settings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, TARGET_LAYERS = 49152, 576, 9, 3, 64, 1536, 30
LAYERS = [1, 8, 15, 22, 29]
GAMMA, ANCHORS, SEQ = 7, 512, 1024


def make_target(folder: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                         num_hidden_layers=TARGET_LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True)
    config.save_pretrained(folder)
    embed = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.02
    save_file({"model.embed_tokens.weight": embed}, str(folder / "model.safetensors"))


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KB


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from torch.utils.flop_counter import FlopCounterMode

    from dspark_cli.model.attention import step_mask
    from dspark_cli.model.config import DrafterConfig
    from dspark_cli.model.drafter import DSparkDrafter
    from dspark_cli.model.frozen import attach_frozen
    from dspark_cli.sample import Sample
    from dspark_cli.target.files import load_config
    from dspark_cli.train.anchors import anchor_generator, sample_anchors
    from dspark_cli.train.blocks import pack
    from dspark_cli.train.loss import DrafterLoss, LossWeights

    gen = torch.Generator().manual_seed(0)
    loss_mask = torch.zeros(SEQ, dtype=torch.bool)
    loss_mask[32:] = True
    sample = Sample("bench", torch.randint(0, VOCAB - 1, (SEQ,), generator=gen), loss_mask,
                    torch.randn(SEQ, len(LAYERS) * HIDDEN, generator=gen).to(torch.bfloat16),
                    torch.randn(int(loss_mask.sum()), HIDDEN, generator=gen).to(torch.bfloat16))
    settings = {"num_draft_layers": args.draft_layers, "block_size": GAMMA,
                "draft_vocab_size": args.draft_vocab}
    config = DrafterConfig.from_target(load_config(args.target), layers=LAYERS,
                                       mask_token_id=VOCAB - 1, model_settings=settings,
                                       target_model=args.target)
    torch.manual_seed(0)
    drafter = DSparkDrafter(config)
    attach_frozen(drafter, args.target)
    fast = args.path in ("fast", "fast-eager")
    compiled = False
    if fast:  # as the trainer does under train.fast_kernels on CPU
        from dspark_cli.train.host_memory import keep_freed_memory
        from dspark_cli.train.vocab_kernel import wanted

        keep_freed_memory()
        compiled = args.path == "fast" and wanted("auto", torch.device("cpu"), args.precision == "bf16")
    module = DrafterLoss(drafter, LossWeights(), chunk_blocks=args.chunk, fast_kernels=fast,
                         compile_vocab=compiled)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4,
                                  fused=fast or None)  # as the trainer makes it
    anchors = sample_anchors(loss_mask, ANCHORS, anchor_generator(0, 0, 0))
    batch = pack([sample], [anchors], config)
    setup_mb = rss_mb()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def step() -> float:
        mask = step_mask(batch.layout, flex=False, split=fast)  # the trainer makes one per step
        with autocast:
            loss, _ = module(batch, mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    t0 = time.perf_counter()
    first_loss = step()  # warm-up: compile (compile_vocab), allocator, optimizer state, packed weights
    first_step = time.perf_counter() - t0
    # A second warm-up, counting FLOPs (the compiled kernel runs eagerly under the counter, so the
    # first step compiles it outside); the heap also settles (train/host_memory.py).
    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    # The median step: this VM's speed drifts by tens of percent between minutes, and one slow
    # step would otherwise decide the figure (the trainer runs hundreds of them).
    per_step = statistics.median(times)
    compiled = compiled and not module.workspace.kernel.failed
    print(json.dumps({"path": args.path, "compiled": compiled, "first_step_seconds": first_step,
                      "draft_vocab": args.draft_vocab,
                      "chunk_blocks": args.chunk, "anchors": batch.num_blocks,
                      "gamma": GAMMA, "draft_layers": args.draft_layers, "threads": args.threads,
                      "steps": args.steps, "precision": args.precision, "flops_per_step": flops,
                      "steps_per_s": 1 / per_step, "achieved_tflops": flops / per_step / 1e12,
                      "anchor_slots_per_s": batch.num_blocks * GAMMA / per_step, "seconds_per_step": per_step,
                      "step_seconds": [round(t, 3) for t in times],
                      "setup_rss_mb": setup_mb, "peak_rss_mb": rss_mb(), "first_loss": first_loss,
                      "loss": loss}))


def peak_tflops(threads: int, precision: str) -> float:
    """The best of a few 2048 × 2048 matmuls in the step's precision: this machine's attainable peak."""
    import torch

    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    out = torch.empty(2048, 2048, dtype=dtype)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048 ** 3 / best / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps; the median is reported")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="bf16 autocast (the demo's setting), fp32, or auto: bf16 where the CPU has "
                             "native bf16 (AVX512-BF16/AMX), else fp32")
    parser.add_argument("--paths", default="fast,earlier",
                        help="settings to compare: fast (train.fast_kernels, compile_vocab auto), "
                             "fast-eager (fast_kernels, compile_vocab false), earlier (fast_kernels false)")
    parser.add_argument("--chunks", default="64", help="loss_chunk_blocks settings to compare (0 = off)")
    parser.add_argument("--draft-vocabs", default="0",
                        help="model.draft_vocab_size settings of the fast paths (0 = the full vocabulary)")
    parser.add_argument("--draft-vocab", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="fast", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--target", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.precision == "auto":  # without native bf16 PyTorch's bf16 gemms run at ~1-8 GFLOP/s
        from dspark_cli.target.dtypes import cpu_has_fast_bf16

        args.precision = "bf16" if cpu_has_fast_bf16() else "fp32"
        print(f"precision auto: {args.precision} (native bf16 matmuls: "
              f"{'yes' if args.precision == 'bf16' else 'no'})", flush=True)
    print(f"bench-train: SmolLM2-135M-sized drafter (V={VOCAB}, d={HIDDEN}, {HEADS}/{KV_HEADS} heads), "
          f"γ={GAMMA}, {ANCHORS} anchors of a {SEQ}-token sample, {args.draft_layers} draft layer(s), "
          f"{args.steps} timed step(s) (median) after 2 warm-ups, {args.threads} thread(s), "
          f"{args.precision}; random target weights of SmolLM2's shape; each setting in a fresh "
          "process.", flush=True)
    peak = peak_tflops(args.threads, args.precision)
    print(f"  peak: {peak:.3f} TFLOP/s ({args.precision} 2048 × 2048 matmul, {args.threads} thread(s))",
          flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        make_target(Path(tmp))
        vocabs = [int(v) for v in args.draft_vocabs.split(",")]
        settings = [(path, chunk, vocab) for path in args.paths.split(",")
                    for chunk in (int(c) for c in args.chunks.split(","))
                    for vocab in (vocabs if path != "earlier" else [0])]
        for path, chunk, vocab in settings:
            cmd = [sys.executable, __file__, "--child", "--path", path, "--chunk", str(chunk),
                   "--target", tmp, "--draft-layers", str(args.draft_layers), "--steps", str(args.steps),
                   "--threads", str(args.threads), "--precision", args.precision,
                   "--draft-vocab", str(vocab)]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                sys.exit(f"setting {path} chunk={chunk} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            tag = "" if path == "fast" else f"[{path}]"
            tag += f"[draft_vocab={vocab}]" if vocab else ""
            chunking = f"chunk {chunk} blocks" if chunk else "no chunking"
            print(f"bench-train{tag} steps_per_s={r['steps_per_s']:.4f} achieved_tflops="
                  f"{r['achieved_tflops']:.4f} peak_tflops={peak:.4f}", flush=True)
            kernels = {"fast": f"true, compile_vocab={'true' if r['compiled'] else 'false'}",
                       "fast-eager": "true, compile_vocab=false"}.get(path, "false")
            print(f"  fast_kernels={kernels}, {chunking}: first step {r['first_step_seconds']:.1f} s, "
                  f"{r['seconds_per_step']:.2f} s/step (median of {r['step_seconds']}), "
                  f"{r['flops_per_step'] / 1e9:.0f} GFLOP/step "
                  f"(FlopCounterMode), {r['anchor_slots_per_s']:.0f} anchor-slots/s, peak RSS "
                  f"{r['peak_rss_mb']:.0f} MB (+{r['peak_rss_mb'] - r['setup_rss_mb']:.0f} over setup), "
                  f"loss {r['first_loss']:.4f} → {r['loss']:.4f}", flush=True)
    runs = {(r["path"], r["chunk_blocks"]): r for r in results if not r["draft_vocab"]}
    for r in results:
        full = runs.get((r["path"], r["chunk_blocks"]))
        if r["draft_vocab"] and full:
            ratio = r["steps_per_s"] / full["steps_per_s"]
            print(f"bench-train draft_vocab={r['draft_vocab']}: {ratio:.2f}x steps/s of the full vocabulary"
                  f" ({r['path']}, chunk {r['chunk_blocks']})")
    for chunk in (int(c) for c in args.chunks.split(",")):
        fast, earlier = runs.get(("fast", chunk)), runs.get(("earlier", chunk))
        if fast and earlier:
            print(f"bench-train speedup={fast['steps_per_s'] / earlier['steps_per_s']:.2f}x steps/s "
                  f"(fast_kernels true vs false, chunk {chunk}; goal ≥ 2x); first-step loss "
                  f"{fast['first_loss']:.5f} vs {earlier['first_loss']:.5f}")
    by = {r["chunk_blocks"]: r for r in results if r["path"] == results[0]["path"]}
    if 0 in by and len(by) > 1:
        off = by[0]
        for chunk, r in by.items():
            if chunk:
                total = r["peak_rss_mb"] / off["peak_rss_mb"]
                growth = (r["peak_rss_mb"] - r["setup_rss_mb"]) / (off["peak_rss_mb"] - off["setup_rss_mb"])
                print(f"  chunk {chunk}: peak RSS {100 * total:.0f}% of unchunked; training-step growth "
                      f"{100 * growth:.0f}% of unchunked (goal ≤ 40%: {'met' if total <= 0.4 else 'not met'} "
                      f"on total peak, {'met' if growth <= 0.4 else 'not met'} on growth)")


if __name__ == "__main__":
    main()
