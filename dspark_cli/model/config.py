"""DrafterConfig: every size the drafter needs, derived once from the target's HF config.

The drafter borrows its width, heads, KV heads, head dim, RoPE and vocabulary from the target so
its layers line up with the target's features and its frozen embedding / lm_head rows. The DSpark
choices (γ, Markov head, confidence head, block convention) come from the [model] settings.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..settings.model import CONVENTIONS, MARKOV_TYPES, ModelSettings


@dataclass
class DrafterConfig:
    """Architecture of a DSpark (or DFlash baseline) drafter; JSON round-trips exactly."""

    # Borrowed from the target.
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default",
                                                                       "rope_theta": 10000.0})
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    num_target_layers: int = 0
    #: Where the frozen embedding / lm_head come from (a folder or hub id).
    target_model: str = ""
    # Which target features and tokens the drafter reads.
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = 0
    # DSpark choices: the [model] settings, whose defaults are the defaults here too.
    num_draft_layers: int = ModelSettings.num_draft_layers
    block_size: int = ModelSettings.block_size
    block_convention: str = ModelSettings.block_convention
    markov_head_type: str = ModelSettings.markov_head_type
    markov_rank: int = ModelSettings.markov_rank
    enable_confidence_head: bool = ModelSettings.enable_confidence_head
    confidence_head_with_markov: bool = ModelSettings.confidence_head_with_markov
    tie_k_norm: bool = ModelSettings.tie_k_norm
    #: N > 0: a reduced draft vocabulary of N target tokens (the drafter's `draft_token_ids`).
    draft_vocab_size: int = ModelSettings.draft_vocab_size

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_context_layers(self) -> int:
        """m: how many target layers are concatenated into the context features."""
        return len(self.target_layer_ids)

    @property
    def block_inputs(self) -> int:
        """Slots fed per block: γ (anchor_first) or γ + 1 (fill_in: the anchor slot's output is unused)."""
        return self.block_size + (1 if self.block_convention == "fill_in" else 0)

    @property
    def draft_vocab(self) -> int:
        """Logits per draft slot: the reduced draft vocabulary's N, else the target's V."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def sample_from_anchor(self) -> bool:
        return self.block_convention == "anchor_first"

    def validate(self) -> None:
        if not self.target_layer_ids:
            raise ConfigError("target.layers must name at least one target layer for the drafter.")
        if any(b <= a for a, b in zip(self.target_layer_ids, self.target_layer_ids[1:], strict=False)):
            raise ConfigError(f"target.layers must be strictly increasing, got {self.target_layer_ids}.")
        if self.num_target_layers and self.target_layer_ids[-1] >= self.num_target_layers:
            raise ConfigError(f"target.layers {self.target_layer_ids} must be < the target's "
                              f"{self.num_target_layers} layers.")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"target.mask_token_id {self.mask_token_id} is not a row of the target "
                              f"embedding (vocab size {self.vocab_size}); pick a spare row "
                              f"< {self.vocab_size}.")
        if not 0 <= self.draft_vocab_size < self.vocab_size:
            raise ConfigError(f"model.draft_vocab_size {self.draft_vocab_size} must be smaller than the "
                              f"target's vocabulary ({self.vocab_size}); 0 keeps the full vocabulary.")
        if self.draft_vocab_size and (self.markov_head_type not in ("vanilla", "gated")
                                      or self.block_convention != "anchor_first"):
            raise ConfigError("model.draft_vocab_size needs an anchor_first drafter with a vanilla or gated "
                              "Markov head (its extra rank keeps other tokens out where no d2t is read), "
                              f"got {self.block_convention} / {self.markov_head_type}.")
        if self.markov_head_type not in MARKOV_TYPES:
            raise ConfigError(f"model.markov_head_type must be one of {', '.join(MARKOV_TYPES)}, "
                              f"got {self.markov_head_type!r}.")
        if self.block_convention not in CONVENTIONS:
            raise ConfigError(f"model.block_convention must be anchor_first or fill_in, "
                              f"got {self.block_convention!r}.")
        if (self.enable_confidence_head and self.confidence_head_with_markov
                and self.markov_head_type == "none"):
            raise ConfigError("model.confidence_head_with_markov needs a Markov head (its W1); set it "
                              "to false or choose model.markov_head_type.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{self.num_attention_heads} attention heads are not a multiple of "
                              f"{self.num_key_value_heads} KV heads.")

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_target(cls, target_config: Any, *, layers: list[int], mask_token_id: int | None,
                    model_settings: Any = None, target_model: str = "") -> DrafterConfig:
        """Derive from a Transformers config of any decoder family (Qwen3, Llama, …)."""
        if mask_token_id is None:
            raise ConfigError("target.mask_token_id is not set; the drafter needs a spare embedding row "
                              "as its mask token (e.g. 151669 for Qwen3), never pad/eos.")
        tc = getattr(target_config, "text_config", None) or target_config
        _refuse_busy_mask_token(int(mask_token_id), (target_config, tc))
        heads = tc.num_attention_heads
        rope = getattr(tc, "rope_parameters", None) or {
            "rope_type": "default", "rope_theta": float(getattr(tc, "rope_theta", 10000.0))}
        ms = model_settings.to_dict() if hasattr(model_settings, "to_dict") else dict(model_settings or {})
        return cls(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            vocab_size=tc.vocab_size,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            rope_parameters=dict(rope),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
            tie_word_embeddings=bool(getattr(target_config, "tie_word_embeddings", False)),
            num_target_layers=tc.num_hidden_layers,
            target_model=str(target_model),
            target_layer_ids=list(layers),
            mask_token_id=int(mask_token_id),
            **{k: ms[k] for k in ("num_draft_layers", "block_size", "block_convention", "markov_head_type",
                                  "markov_rank", "enable_confidence_head", "confidence_head_with_markov",
                                  "tie_k_norm", "draft_vocab_size")
               if k in ms},
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_json(cls, text: str) -> DrafterConfig:
        return cls.from_dict(json.loads(text))

    def hf_rope_config(self) -> Any:
        """A minimal Transformers config carrying the RoPE settings, for its rotary embedding."""
        from transformers import Qwen3Config

        return Qwen3Config(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=dict(self.rope_parameters))


def _refuse_busy_mask_token(mask_token_id: int, configs: tuple[Any, ...]) -> None:
    """The mask token must be a row chat never produces: the target's bos, eos or pad token is
    written in every conversation, so a mask equal to one would be indistinguishable from it."""
    for config in configs:
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            ids = getattr(config, key, None)
            ids = ids if isinstance(ids, list | tuple) else [ids]
            if mask_token_id in ids:
                name = key.removesuffix("_id")
                raise ConfigError(f"target.mask_token_id {mask_token_id} is the target's {name}; "
                                  "the mask token must be a row chat never writes.",
                                  hint="`dspark pipeline new --target …` prints one chosen by rule.")
