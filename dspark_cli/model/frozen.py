"""Load only the target's embedding and lm_head from its safetensors, nothing else.

Training never needs the rest of the target: the cache holds its features. We open the shards
with `safe_open` and read two tensors, so a 14B target costs two matrices of memory, not 28 GB.
Tied embeddings (no `lm_head.weight`) reuse the embedding matrix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import DsparkError

EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "transformer.wte.weight")
LM_HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight")


def resolve_target_dir(target: str, files: tuple[str, ...] = ("config.json",)) -> Path:
    """A local folder as is; a hub id through the local HF cache (downloads only `files`)."""
    if os.path.isdir(target):
        return Path(target)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(target, allow_patterns=list(files)))
    except Exception as e:
        raise DsparkError(f"target {target!r}: not a local folder and not fetchable from the hub ({e}).",
                          hint="set target.model to a folder holding config.json and *.safetensors.") from e


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if not single.exists():
        raise DsparkError(f"{folder}: no model.safetensors or model.safetensors.index.json; the drafter "
                          "loads the target's embedding and lm_head from safetensors only.")
    with safe_open(str(single), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def load_embeddings(target: str, tie_word_embeddings: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, d], lm_head [V, d]) read from the target's safetensors."""
    folder = resolve_target_dir(target, ("config.json", "*.json"))
    wmap = _weight_map(folder)
    embed_key = next((k for k in EMBED_KEYS if k in wmap), None)
    head_key = next((k for k in LM_HEAD_KEYS if k in wmap), None)
    if embed_key is None:
        raise DsparkError(f"{folder}: no embedding tensor among {', '.join(EMBED_KEYS)}.")
    if head_key is None and not tie_word_embeddings:
        raise DsparkError(f"{folder}: no lm_head.weight and tie_word_embeddings is false.")
    needed = {wmap[embed_key]} | ({wmap[head_key]} if head_key else set())
    if not os.path.isdir(target):
        folder = resolve_target_dir(target, ("*.json", *sorted(needed)))

    def read(key: str) -> torch.Tensor:
        with safe_open(str(folder / wmap[key]), framework="pt") as f:
            return f.get_tensor(key)

    embed = read(embed_key)
    head = read(head_key) if head_key else embed
    return embed, head


def load_target_config(target: str, trust_remote_code: bool = False):
    """The target's Transformers config (only config.json is read)."""
    from transformers import AutoConfig

    folder = resolve_target_dir(target)
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise DsparkError(f"{target}: cannot read the target config ({e}).") from e


def attach_frozen(drafter: torch.nn.Module, target: str) -> None:
    """Copy the target's embedding and lm_head into the drafter (shapes checked)."""
    cfg = drafter.config
    embed, head = load_embeddings(target, cfg.tie_word_embeddings)
    for name, tensor, param in (("embedding", embed, drafter.embed_tokens.weight),
                                ("lm_head", head, drafter.lm_head.weight)):
        if tuple(tensor.shape) != tuple(param.shape):
            raise DsparkError(f"{target}: {name} has shape {tuple(tensor.shape)}, the drafter expects "
                              f"{tuple(param.shape)} (vocab {cfg.vocab_size}, hidden {cfg.hidden_size}).")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
