"""Load only the target's embedding and lm_head from its safetensors, nothing else.

Training never needs the rest of the target: the cache holds its features. We open the shards
with `safe_open` and read two tensors, so a 14B target costs two matrices of memory, not 28 GB.
Tied embeddings (no `lm_head.weight`) reuse the embedding matrix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import DsparkError, reading
from ..target.files import is_local, resolve_folder

EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "transformer.wte.weight")
LM_HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight")


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if not single.exists():
        raise DsparkError(f"{folder}: no model.safetensors or model.safetensors.index.json; the drafter "
                          "loads the target's embedding and lm_head from safetensors only.")
    with reading(str(single)), safe_open(str(single), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def load_embeddings(target: str, tie_word_embeddings: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, d], lm_head [V, d]) read from the target's safetensors."""
    folder = resolve_folder(target, ("config.json", "*.json"))
    wmap = _weight_map(folder)
    embed_key = next((k for k in EMBED_KEYS if k in wmap), None)
    head_key = next((k for k in LM_HEAD_KEYS if k in wmap), None)
    if embed_key is None:
        raise DsparkError(f"{folder}: no embedding tensor among {', '.join(EMBED_KEYS)}.")
    if head_key is None and not tie_word_embeddings:
        raise DsparkError(f"{folder}: no lm_head.weight and tie_word_embeddings is false.")
    needed = {wmap[embed_key]} | ({wmap[head_key]} if head_key else set())
    if not is_local(target):
        folder = resolve_folder(target, ("*.json", *sorted(needed)))

    def read(key: str) -> torch.Tensor:
        with reading(str(folder / wmap[key])), safe_open(str(folder / wmap[key]), framework="pt") as f:
            return f.get_tensor(key)

    embed = read(embed_key)
    head = read(head_key) if head_key else embed
    return embed, head


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
