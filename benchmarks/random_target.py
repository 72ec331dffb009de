"""A target of a real model's exact architecture and shapes with random bf16 weights, for
rehearsing every stage at full size without the hub (`make rehearse`, docs/rehearse.md).

Memory stays near one shard: the model is built on the meta device only to learn its tensor
names and shapes, then each tensor is drawn in bf16 and written with the shard it belongs to
(never an fp32 copy of the model, never a default `from_config` init). The folder is written
under a temporary name and renamed once the marker is in it, so a killed run leaves nothing
that looks finished; a rerun with the same shapes reuses it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

MARKER = "random-target.json"
#: Normal init spread of every matrix (Qwen3's initializer_range); norms start at 1.
INIT_STD = 0.02


def target_config(shape: dict[str, Any], tokenizer: Any) -> Any:
    """A real Qwen3ForCausalLM config of `shape` (e.g. plan.shapes.KNOWN_TARGETS["Qwen/Qwen3-4B"])
    whose special ids are the tokenizer's, so stop ids and chat rendering agree with it."""
    from transformers import Qwen3Config

    config = Qwen3Config(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    config.architectures = ["Qwen3ForCausalLM"]
    config.dtype = torch.bfloat16
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than the vocabulary "
                         f"{config.vocab_size}")
    return config


def tensor_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes, from the model built on the meta device (a tied
    lm_head is not stored, as save_pretrained leaves it out)."""
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def plan_shards(shapes: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most `shard_bytes` (bf16), one tensor at least."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = 2 * int(torch.Size(shape).numel())
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, INIT_STD, generator=generator)


def write_random_target(out: Path, shape: dict[str, Any], tokenizer_from: str, seed: int = 0,
                        shard_bytes: int = 2 * 2**30) -> Path:
    """Write (or reuse) a random-weights target of `shape` with the tokenizer of `tokenizer_from`."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    spec = {"shape": shape, "tokenizer_from": str(tokenizer_from), "seed": seed, "init_std": INIT_STD}
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = target_config(shape, tokenizer)
    shapes = tensor_shapes(config)
    shards = plan_shards(shapes, shard_bytes)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(name, shapes[name], generator) for name in names}
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps(spec, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Write a random-weights target (benchmarks/random_target.py).")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--shape", required=True, help="JSON object of Qwen3Config fields")
    ap.add_argument("--tokenizer-from", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    write_random_target(args.out, json.loads(args.shape), args.tokenizer_from, args.seed)
    print(f"random target: {args.out}")


if __name__ == "__main__":
    main()
