"""A fresh drafter's layers started from the target's own (`train.backbone_init = "target"`).

The drafter's context path reads the deepest captured layer's output, which is exactly the input
of the target layer after it. So, before the first step:

- drafter layer j is a copy of target layer s + j, where s is the layer after the deepest captured
  one (moved down when fewer than n layers follow it);
- `fc` is the identity on that captured layer's slice of the concatenated features (the other
  layers' slices start at zero and learn like any weight);
- `hidden_norm` is target layer s's input norm, and the final norm is the target's.

At step 0 drafter layer 0's context keys and values are then target layer s's own for those
positions (tests/test_backbone_init.py checks them against Transformers' layer).

The per-head q/k norms: Qwen3-style targets have them, and they are copied. Llama-style targets
do not, while the drafter (like the engines' DSpark loaders) always normalises q and k per head.
There each norm's gain starts at the RMS the target's own q/k heads have on the cached features,
so attention logits start at the target's scale (SmolLM2-135M: ~2.0 for both, where a gain of 1
would shrink every logit ~4×).

Only decoders whose layers have these parts and plain RMSNorm weights are supported (Llama,
Mistral, Qwen2, Qwen3). Gemma stores its norms as 1 + w and has extra norms; it is refused
rather than copied wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..sample import Sample
from .drafter import DSparkDrafter
from .frozen import read_decoder_tensors

#: Transformers model types whose decoder layers the drafter's layer mirrors.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
#: Samples whose cached features set the q/k norm gains of a target without q/k norms.
SCALE_SAMPLES = 8
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def source_layers(num_target_layers: int, deepest_captured: int, num_draft_layers: int) -> list[int]:
    """The target layers the drafter's layers start as: those right after the deepest captured
    layer, or the last num_draft_layers when fewer follow it."""
    if num_draft_layers > num_target_layers:
        raise ConfigError(f"train.backbone_init = \"target\" copies {num_draft_layers} target layers, "
                          f"but the target has {num_target_layers}.")
    first = min(deepest_captured + 1, num_target_layers - num_draft_layers)
    return list(range(first, first + num_draft_layers))


def _model_type(target: str) -> str:
    from ..target.files import load_config, text_config

    return str(getattr(text_config(load_config(target)), "model_type", "") or "")


@torch.no_grad()
def qk_gains(features: torch.Tensor, norm: torch.Tensor, q_proj: torch.Tensor, k_proj: torch.Tensor,
             head_dim: int, eps: float) -> tuple[float, float]:
    """Mean per-head RMS of the target layer's queries and keys on features [N, d] (its input)."""
    x = F.rms_norm(features.float(), features.shape[-1:], norm.float(), eps)
    q = (x @ q_proj.float().T).unflatten(-1, (-1, head_dim))
    k = (x @ k_proj.float().T).unflatten(-1, (-1, head_dim))
    return float(q.pow(2).mean(-1).sqrt().mean()), float(k.pow(2).mean(-1).sqrt().mean())


def _features(samples: Sequence[Sample], columns: slice, limit: int = SCALE_SAMPLES) -> torch.Tensor | None:
    """The deepest captured layer's output [N, d] (its columns of the cached features)."""
    rows = [s.hidden_states[:, columns] for s in (samples[i] for i in range(min(limit, len(samples))))
            if s.hidden_states is not None and len(s.hidden_states)]
    return torch.cat(rows) if rows else None


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ConfigError(f"train.backbone_init = \"target\": the target's {name} has shape "
                          f"{tuple(tensor.shape)}, the drafter's is {tuple(param.shape)}.")
    param.copy_(tensor.to(param.dtype))


@torch.no_grad()
def init_backbone_from_target(drafter: DSparkDrafter, target: str,
                              samples: Sequence[Sample]) -> dict[str, Any]:
    """Start the drafter's layers, fc and norms from the target's (module doc); returns what was
    done, for the manifest."""
    cfg = drafter.config
    model_type = _model_type(target)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"train.backbone_init = \"target\" supports {', '.join(SUPPORTED_MODEL_TYPES)} "
                          f"targets, not {model_type or 'this one'!r}.",
                          hint="set train.backbone_init = \"random\".")
    deepest = max(cfg.target_layer_ids)
    sources = source_layers(cfg.num_target_layers, deepest, len(drafter.layers))
    names = [f"layers.{s}.{p}.weight" for s in sources for p in (*PROJECTIONS, *LAYER_NORMS)]
    qk_norm_names = [f"layers.{s}.self_attn.{n}.weight" for s in sources for n in ("q_norm", "k_norm")]
    weights = read_decoder_tensors(target, [*names, "norm.weight"], optional=tuple(qk_norm_names))
    for layer, s in zip(drafter.layers, sources, strict=True):
        for path in (*PROJECTIONS, *LAYER_NORMS):
            _copy(layer.get_submodule(path).weight, weights[f"layers.{s}.{path}.weight"],
                  f"layers.{s}.{path}.weight")
    d = cfg.hidden_size
    start = list(cfg.target_layer_ids).index(deepest) * d
    columns = slice(start, start + d)  # the deepest layer's features in the concatenation
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, columns] = torch.eye(d, dtype=drafter.fc.weight.dtype)
    _copy(drafter.hidden_norm.weight, weights[f"layers.{sources[0]}.input_layernorm.weight"],
          f"layers.{sources[0]}.input_layernorm.weight")
    _copy(drafter.norm.weight, weights["norm.weight"], "norm.weight")
    done: dict[str, Any] = {"source_layers": sources, "model_type": model_type}
    if all(n in weights for n in qk_norm_names):
        qk = [(weights[f"layers.{s}.self_attn.q_norm.weight"], weights[f"layers.{s}.self_attn.k_norm.weight"])
              for s in sources]
        done["qk_norm"] = "copied"
    else:
        features = _features(samples, columns)
        if features is None:
            raise ConfigError("train.backbone_init = \"target\" on a target without q/k norms needs cached "
                              "features to set their gains, and the training split has none.")
        gains = [qk_gains(features, weights[f"layers.{s}.input_layernorm.weight"],
                          weights[f"layers.{s}.self_attn.q_proj.weight"],
                          weights[f"layers.{s}.self_attn.k_proj.weight"], cfg.head_dim, cfg.rms_norm_eps)
                 for s in sources]
        qk = [(torch.full((cfg.head_dim,), q), torch.full((cfg.head_dim,), k)) for q, k in gains]
        done["qk_norm"] = {"q_gain": [round(q, 4) for q, _ in gains],
                           "k_gain": [round(k, 4) for _, k in gains]}
    for layer, s, (q, k) in zip(drafter.layers, sources, qk, strict=True):
        _copy(layer.self_attn.q_norm.weight, q, f"layers.{s}.self_attn.q_norm.weight")
        _copy(layer.self_attn.k_norm.weight, k, f"layers.{s}.self_attn.k_norm.weight")
    if cfg.tie_k_norm:  # one module shared by every layer: layer 0's, not the last one written
        drafter.layers[0].self_attn.k_norm.weight.copy_(qk[0][1])
    return done
