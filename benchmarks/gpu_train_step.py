"""The trainer on a Qwen3-4B-shaped drafter at real width, a few optimizer steps (`make gpu-check`).

    python -m benchmarks.gpu_train_step --out runs/gpu-check/qwen3-4b --device cuda

What a CPU machine cannot run: the CUDA path of `dspark train` (flex-attention BlockMask compiled
with dynamic shapes, bf16 autocast, the chunked loss over Qwen3's 151,936-token vocabulary) with
pipelines/qwen3-4b.toml's model and train settings (5 draft layers, γ = 7, 512 anchors, Markov +
confidence heads) on width 2560. The target is random and holds only what training reads of it:
its config (Qwen3-4B's published shapes, plan/shapes.py) and its embedding (tied lm_head); the
features are random tensors of the cache's shapes (5 layers × 2560, bf16), fed to the trainer as
its dataset. Prints `gpu-train-step: step N s=… peak_gb=…` per step and a summary line.
`--device cpu --draft-layers 1 --length 256 --anchors 16` rehearses the script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def write_target(out: Path, shape: str) -> Path:
    """config.json of the shape, and its embedding (random bf16) as model.safetensors."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    from dspark_cli.plan.shapes import KNOWN_TARGETS

    if (out / "model.safetensors").exists():
        return out
    spec = KNOWN_TARGETS[shape]
    Qwen3Config(**{k: v for k, v in spec.items() if k != "model_type"}).save_pretrained(out)
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(spec["vocab_size"], spec["hidden_size"], generator=gen) * 0.02
    tensors = {"model.embed_tokens.weight": embed.to(torch.bfloat16)}
    if not spec["tie_word_embeddings"]:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(out / "model.safetensors"))
    return out


def samples(n: int, length: int, layers: int, hidden: int, vocab: int) -> list:
    """Random samples of the cache's shapes: a prompt third, then a supervised response."""
    from dspark_cli.sample import Sample

    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (length,), generator=gen)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 3:] = True
        states = torch.randn(length, layers * hidden, generator=gen).to(torch.bfloat16)
        final = torch.randn(int(mask.sum()), hidden, generator=gen).to(torch.bfloat16)
        out.append(Sample(f"g{i}", ids, mask, states, final))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu-check" / "qwen3-4b"))
    parser.add_argument("--shape", default="Qwen/Qwen3-4B")
    parser.add_argument("--config", default=str(ROOT / "pipelines" / "qwen3-4b.toml"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048, help="tokens per sample")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--anchors", type=int, default=None, help="default: the config's (512)")
    parser.add_argument("--draft-layers", type=int, default=None, help="default: the config's (5)")
    args = parser.parse_args()

    from dspark_cli.config import load_config
    from dspark_cli.plan.shapes import KNOWN_TARGETS
    from dspark_cli.train.trainer import train

    out = Path(args.out)
    target = write_target(out / "target", args.shape)
    sets = [f"target.model='{target}'", f"train.device='{args.device}'", "train.precision='bf16'",
            f"train.max_steps={args.steps}", f"train.global_batch={args.global_batch}",
            f"train.micro_batch={args.micro_batch}", "train.save_every=1000000", "train.eval_samples=0",
            f"pipeline.work_dir='{out}'"]
    if args.anchors is not None:
        sets.append(f"train.num_anchors={args.anchors}")
    if args.draft_layers is not None:
        sets.append(f"model.num_draft_layers={args.draft_layers}")
    cfg = load_config(args.config, sets)
    spec = KNOWN_TARGETS[args.shape]
    data = samples(args.global_batch * args.steps, args.length, len(cfg.target.layers), spec["hidden_size"],
                   spec["vocab_size"])
    cuda = torch.device(args.device).type == "cuda"
    times: list[float] = []
    last = [time.perf_counter()]

    def on_step(step: int, record: dict) -> None:
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        print(f"gpu-train-step: step {step} s={times[-1]:.2f} loss={record.get('loss', float('nan')):.3f} "
              f"peak_gb={peak:.1f}", flush=True)

    started = time.perf_counter()
    train(cfg, "gpu-check:qwen3-4b-shape", str(out / "train"), force=True, dataset=data, validation=[],
          on_step_end=on_step)
    summary = {"shape": args.shape, "device": args.device, "steps": len(times),
               "first_step_s": round(times[0], 2) if times else None,
               "later_step_s": round(sum(times[1:]) / max(len(times) - 1, 1), 3) if len(times) > 1 else None,
               "total_s": round(time.perf_counter() - started, 1),
               "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"gpu-train-step: {json.dumps(summary)}")


if __name__ == "__main__":
    main()
