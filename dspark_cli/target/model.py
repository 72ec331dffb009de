"""Load the target (safetensors only) and its tokenizer; `Target` bundles them with what they imply.

    target = Target.load("runs/smollm2", dtype="bfloat16", device="auto")
    target = Target.from_settings(cfg.target)               # [target] model, dtype, device, ...
    model, tokenizer = load_target("runs/smollm2", "float32", "cpu")

Remote code is off unless asked for; a local folder is read with `local_files_only`, so it never
touches the hub (offline machines, air-gapped clusters).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DsparkError, environment_error
from . import capture as _capture
from . import chat, decode_attention, identity
from .dtypes import auto_dtype, resolve_device, torch_dtype
from .files import LOAD_HINT, first_line, hidden_size, hub_kwargs, num_layers
from .layers import resolve_layers
from .prepack import prepack_linears


def _hub_kwargs(path_or_id: str, revision: str | None, trust_remote_code: bool) -> dict[str, Any]:
    return {**hub_kwargs(path_or_id, revision), "trust_remote_code": trust_remote_code}


def load_tokenizer(path_or_id: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer (and chat template) without its weights."""
    from transformers import AutoTokenizer

    hub = _hub_kwargs(path_or_id, revision, trust_remote_code)
    try:
        return AutoTokenizer.from_pretrained(path_or_id, **hub)
    except (OSError, ValueError, KeyError) as e:  # ValueError: no tokenizer file in the folder
        raise DsparkError(f"target {path_or_id!r}: cannot load its tokenizer ({first_line(e)}).",
                          hint=LOAD_HINT) from e


def load_target(path_or_id: str, dtype: str | torch.dtype = "bfloat16", device: str = "auto",
                trust_remote_code: bool = False, revision: str | None = None,
                local_rank: int = 0, prepack: bool = False) -> tuple[Any, Any]:
    """A causal LM and its tokenizer, frozen and in eval mode on `device` ('auto' dtype allowed);
    with `prepack`, its linear weights packed where that pays (target/prepack.py)."""
    from transformers import AutoModelForCausalLM

    hub = _hub_kwargs(path_or_id, revision, trust_remote_code)
    dev = resolve_device(device, local_rank)
    if isinstance(dtype, str):
        dtype = auto_dtype(dtype, dev)
    tokenizer = load_tokenizer(path_or_id, revision, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=torch_dtype(dtype),
                                                     use_safetensors=True, **hub)
    except Exception as e:  # ValueError/KeyError: an unknown model type; SafetensorError: a damaged file
        if not isinstance(e, OSError | ValueError | KeyError) and environment_error(e) is None:
            raise
        raise DsparkError(f"target {path_or_id!r}: cannot load it ({first_line(e)}).", hint=LOAD_HINT) from e
    model.to(dev).eval()
    model.requires_grad_(False)
    decode_attention.install(model)  # one-token steps on the CPU: same maths, ~15% faster (its doc)
    if prepack:
        prepack_linears(model)
    return model, tokenizer


@dataclass(eq=False)
class Target:
    """A loaded target: model, tokenizer and everything derived from them, in one place."""

    model: Any
    tokenizer: Any
    path: str = ""

    @classmethod
    def load(cls, path: str, dtype: str = "bfloat16", device: str = "auto", trust_remote_code: bool = False,
             revision: str | None = None, local_rank: int = 0, prepack: bool = False) -> Target:
        return cls(*load_target(path, dtype, device, trust_remote_code, revision, local_rank, prepack),
                   path=path)

    @classmethod
    def from_settings(cls, settings: Any, path: str | None = None, local_rank: int = 0) -> Target:
        """From a `[target]` section (`path` overrides target.model, e.g. a --target flag)."""
        return cls.load(path or settings.model, settings.dtype, settings.device, settings.trust_remote_code,
                        settings.revision, local_rank, settings.prepack)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return num_layers(self.model)

    @property
    def hidden_size(self) -> int:
        return hidden_size(self.model)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    @functools.cached_property
    def stop_ids(self) -> set[int]:
        return chat.stop_ids(self.tokenizer, self.model)

    @property
    def config_hash(self) -> str:
        return identity.config_hash(self.model)

    @property
    def template_hash(self) -> str:
        return identity.template_hash(self.tokenizer)

    def resolve_layers(self, spec: Any, where: str = "--layers") -> list[int]:
        return resolve_layers(spec, self.num_layers, where)

    def render(self, messages: list[dict[str, Any]], thinking: bool | None = None,
               template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids (with the generation prompt) of a conversation."""
        return chat.render_prompt(self.tokenizer, messages, thinking, template_kwargs)

    def capture(self, input_ids: Any, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence → (hidden [T, m*d], final [T, d])."""
        return _capture.capture_layers(self.model, input_ids, layers)

    def step(self, new_ids: Any, layers: list[int], past_key_values: Any = None) -> _capture.Capture:
        """Incremental capture with a KV cache (decoding)."""
        return _capture.capture_step(self.model, new_ids, layers, past_key_values)
