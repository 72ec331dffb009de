"""The shapes a plan needs: the target's config (its config.json, or a built-in table for the
reference targets when their config cannot be read offline) and the drafter built from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import PipelineConfig
from ..errors import DsparkError
from ..model.config import DrafterConfig
from ..target.layers import resolve_layers

_QWEN3 = dict(model_type="qwen3", num_attention_heads=32, num_key_value_heads=8, head_dim=128,
              vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960)
#: Published Qwen3 shapes (their config.json), for planning without the hub.
KNOWN_TARGETS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-4B": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                      "tie_word_embeddings": True},
    "Qwen/Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                      "tie_word_embeddings": False},
    "Qwen/Qwen3-14B": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
                       "num_attention_heads": 40, "tie_word_embeddings": False},
}


@dataclass(frozen=True)
class TargetShape:
    """What the plan reads of the target: sizes and its parameter count."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    #: Where the shapes came from: "config.json" or "built-in table".
    origin: str

    @property
    def parameters(self) -> int:
        """Decoder layers (Qwen3/Llama layout, q/k norms) + embedding (+ lm_head when untied)."""
        d, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = d * (q + 2 * kv) + q * d + 3 * d * i + 2 * d + 2 * self.head_dim
        vocab = self.vocab_size * d * (1 if self.tied else 2)
        return self.num_layers * layer + vocab + d


def target_config(cfg: PipelineConfig) -> tuple[Any, str]:
    """(Transformers config, origin): the target's config.json, else the built-in table's entry."""
    from transformers import Qwen3Config

    from ..target.files import load_config

    model = cfg.target.model
    try:
        return load_config(model, cfg.target.revision, cfg.target.trust_remote_code), "config.json"
    except DsparkError as e:
        if model not in KNOWN_TARGETS:
            raise DsparkError(f"{e} The plan knows {', '.join(KNOWN_TARGETS)} offline.",
                              hint="pass --target with the target's folder (only config.json is "
                                   "read).") from None
    return Qwen3Config(**KNOWN_TARGETS[model]), "built-in table"


def shapes(cfg: PipelineConfig) -> tuple[TargetShape, DrafterConfig]:
    """The target's shape and the drafter the config trains on it."""
    config, origin = target_config(cfg)
    tc = getattr(config, "text_config", None) or config
    heads = tc.num_attention_heads
    target = TargetShape(cfg.target.model, tc.hidden_size, tc.intermediate_size, tc.num_hidden_layers, heads,
                         getattr(tc, "num_key_value_heads", None) or heads,
                         getattr(tc, "head_dim", None) or tc.hidden_size // heads, tc.vocab_size,
                         bool(getattr(config, "tie_word_embeddings", False)), origin)
    layers = resolve_layers(cfg.target.layers, target.num_layers)
    drafter = DrafterConfig.from_target(config, layers=layers, mask_token_id=cfg.target.mask_token_id,
                                        model_settings=cfg.model, target_model=cfg.target.model)
    return target, drafter
