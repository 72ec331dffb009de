"""Training throughput and peak memory of a SmolLM2-135M-sized drafter, chunked loss on vs off.

    .venv/bin/python -m benchmarks.bench_train [--draft-layers 1] [--steps 1] [--threads 2]

Shapes are SmolLM2-135M's (vocab 49152, hidden 576, 9 heads / 3 KV heads, head dim 64,
intermediate 1536, 30 target layers, tied embeddings); γ = 7 and 512 anchors per sample. The
target's embedding is random (only its shape matters for speed and memory), written as a
safetensors folder that holds just the embedding and config.json; the cached features are random
bf16 tensors of a 1024-token sample. Each setting runs in a fresh process, so its peak RSS
(ru_maxrss) is its own; we report the peak and the growth over the process's size after setup.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
    from dspark_cli.model.attention import dense_mask
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
    settings = {"num_draft_layers": args.draft_layers, "block_size": GAMMA}
    config = DrafterConfig.from_target(load_config(args.target), layers=LAYERS,
                                       mask_token_id=VOCAB - 1, model_settings=settings,
                                       target_model=args.target)
    torch.manual_seed(0)
    drafter = DSparkDrafter(config)
    attach_frozen(drafter, args.target)
    module = DrafterLoss(drafter, LossWeights(), chunk_blocks=args.chunk)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    anchors = sample_anchors(loss_mask, ANCHORS, anchor_generator(0, 0, 0))
    batch = pack([sample], [anchors], config)
    mask = dense_mask(batch.layout)
    setup_mb = rss_mb()

    def step() -> float:
        loss, _ = module(batch, mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    step()  # warm-up (allocator, optimizer state)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    elapsed = time.perf_counter() - t0
    slots = batch.num_blocks * GAMMA * args.steps
    print(json.dumps({"chunk_blocks": args.chunk, "anchors": batch.num_blocks, "gamma": GAMMA,
                      "draft_layers": args.draft_layers, "threads": args.threads, "steps": args.steps,
                      "anchor_slots_per_s": slots / elapsed, "seconds_per_step": elapsed / args.steps,
                      "setup_rss_mb": setup_mb, "peak_rss_mb": rss_mb(), "loss": loss}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunks", default="64,0", help="loss_chunk_blocks settings to compare (0 = off)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--target", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    print(f"bench-train: SmolLM2-135M-sized drafter (V={VOCAB}, d={HIDDEN}, {HEADS}/{KV_HEADS} heads), "
          f"γ={GAMMA}, {ANCHORS} anchors of a {SEQ}-token sample, {args.draft_layers} draft layer(s), "
          f"{args.steps} timed step(s) after 1 warm-up, {args.threads} thread(s); random target weights "
          f"of SmolLM2's shape; each setting in a fresh process.", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        make_target(Path(tmp))
        for chunk in (int(c) for c in args.chunks.split(",")):
            cmd = [sys.executable, __file__, "--child", "--chunk", str(chunk), "--target", tmp,
                   "--draft-layers", str(args.draft_layers), "--steps", str(args.steps),
                   "--threads", str(args.threads)]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                sys.exit(f"setting chunk={chunk} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            label = f"chunk {chunk} blocks" if chunk else "no chunking"
            print(f"  {label:>16}: {r['anchor_slots_per_s']:8.0f} anchor-slots/s  "
                  f"({r['seconds_per_step']:.1f} s/step)  peak RSS {r['peak_rss_mb']:7.0f} MB  "
                  f"(+{r['peak_rss_mb'] - r['setup_rss_mb']:.0f} MB over setup {r['setup_rss_mb']:.0f} MB)  "
                  f"loss {r['loss']:.4f}", flush=True)
    by = {r["chunk_blocks"]: r for r in results}
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
