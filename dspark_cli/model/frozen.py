"""Load only the tensors training needs from the target's safetensors, nothing else.

Training never needs the rest of the target: the cache holds its features. We open the shards
with `safe_open` and read the embedding and lm_head (and, with `train.backbone_init = "target"`,
the few decoder layers the drafter starts from), so a 14B target costs a few matrices of memory,
not 28 GB. Tied embeddings (no `lm_head.weight`) reuse the embedding matrix.
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


def _weights(target: str) -> tuple[Path, dict[str, str], str]:
    """(folder, tensor name → shard, the embedding's name): every reader's start."""
    folder = resolve_folder(target, ("config.json", "*.json"))
    wmap = _weight_map(folder)
    embed_key = next((k for k in EMBED_KEYS if k in wmap), None)
    if embed_key is None:
        raise DsparkError(f"{folder}: no embedding tensor among {', '.join(EMBED_KEYS)}.")
    return folder, wmap, embed_key


def _read(target: str, folder: Path, wmap: dict[str, str], keys: list[str]) -> dict[str, torch.Tensor]:
    """keys (all in wmap) → tensors, fetching only the shards that hold them."""
    shards = sorted({wmap[k] for k in keys})
    if not is_local(target):
        folder = resolve_folder(target, ("*.json", *shards))
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        with reading(str(folder / shard)), safe_open(str(folder / shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in keys if wmap[k] == shard})
    return out


def load_embeddings(target: str, tie_word_embeddings: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, d], lm_head [V, d]) read from the target's safetensors."""
    folder, wmap, embed_key = _weights(target)
    head_key = next((k for k in LM_HEAD_KEYS if k in wmap), None)
    if head_key is None and not tie_word_embeddings:
        raise DsparkError(f"{folder}: no lm_head.weight and tie_word_embeddings is false.")
    tensors = _read(target, folder, wmap, [embed_key, *([head_key] if head_key else [])])
    return tensors[embed_key], tensors[head_key] if head_key else tensors[embed_key]


def read_decoder_tensors(target: str, names: list[str], optional: tuple[str, ...] = ()
                         ) -> dict[str, torch.Tensor]:
    """Tensors of the target's decoder by their name under the decoder's prefix (the one its
    embedding sits under: `model.` for Llama/Qwen, `model.language_model.` for VLMs), e.g.
    "layers.28.self_attn.q_proj.weight" or "norm.weight". `names` must all exist; `optional` are
    returned when present."""
    folder, wmap, embed_key = _weights(target)
    prefix = embed_key.removesuffix("embed_tokens.weight").removesuffix("wte.weight")
    missing = [prefix + n for n in names if prefix + n not in wmap]
    if missing:
        raise DsparkError(f"{folder}: no tensor {missing[0]} in the target's safetensors"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") + ".")
    keys = [prefix + n for n in (*names, *optional) if prefix + n in wmap]
    return {k.removeprefix(prefix): t for k, t in _read(target, folder, wmap, keys).items()}


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
