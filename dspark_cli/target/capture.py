"""Hidden-state capture: the target's layer outputs and final normed state, one-shot or incremental.

Layer id `i` is `hidden_states[i + 1]` (DESIGN.md §3). The final hidden state is the one after
the model's last norm: in Transformers 5 the base model's `hidden_states[-1]` (checked in tests:
`lm_head(final) == logits`). The forward runs on the decoder without lm_head, so it never
materialises [T, vocab] logits.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ..sample import Sample
from .kv import new_cache


@functools.lru_cache(maxsize=64)
def _cache_kwarg_of(forward: Any) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_kwarg(module: Any) -> str:
    """Transformers 5 renamed the forward's `past_key_values` to `cache`; the name `module` takes."""
    return _cache_kwarg_of(type(module).forward)


def stack_left_padded(cache: Any, attention: torch.Tensor, other: Any,
                      other_attention: torch.Tensor) -> torch.Tensor:
    """Append `other`'s rows under `cache`'s (DynamicCaches; `cache` changes in place), the shorter
    left-padded with masked zeros to the longer's length; returns the stacked [Ra+Rb, T] mask.
    Joining a request to a running batch this way moves no cached position of either."""
    width = max(attention.shape[1], other_attention.shape[1])

    def pad(x: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - x.shape[dim]
        if missing == 0:
            return x
        shape = list(x.shape)
        shape[dim] = missing
        return torch.cat([x.new_zeros(shape), x], dim=dim)

    for mine, new in zip(cache.layers, other.layers, strict=True):
        mine.keys = torch.cat([pad(mine.keys, 2), pad(new.keys, 2)])  # [Ra+Rb, H, T, D]
        mine.values = torch.cat([pad(mine.values, 2), pad(new.values, 2)])
    return torch.cat([pad(attention, 1), pad(other_attention, 1)])


def base_model(model: Any) -> Any:
    """The decoder without lm_head."""
    base = getattr(model, "base_model_prefix", None)
    inner = getattr(model, base, None) if base else None
    return inner if inner is not None else model.get_decoder()


@dataclass
class Capture:
    """Features of one forward: `hidden` [B, T, m*d], `final` [B, T, d], optional KV cache."""

    hidden: torch.Tensor
    final: torch.Tensor
    past_key_values: Any = None


@torch.inference_mode()
def capture_batch(model: Any, input_ids: torch.Tensor, layers: list[int],
                  attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                  use_cache: bool = False, position_ids: torch.Tensor | None = None) -> Capture:
    """Forward a [B, T] batch; return the requested layers concatenated and the final normed state.

    Bit-exact against a single-sequence forward only for unpadded batches (equal lengths): padding
    changes the attention kernels' reduction order. `cache build` therefore batches equal lengths.
    """
    device = next(model.parameters()).device
    base = base_model(model)
    kwargs: dict[str, Any] = {"input_ids": input_ids.to(device), "use_cache": use_cache,
                              "output_hidden_states": True}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask.to(device)
    if position_ids is not None:  # ragged rows (batched decoding): each row's own positions
        kwargs["position_ids"] = position_ids.to(device)
    if past_key_values is not None:
        kwargs[cache_kwarg(base)] = past_key_values
    out = base(**kwargs)
    states = out.hidden_states  # num_layers + 1 tensors of [B, T, d]
    hidden = torch.cat([states[i + 1] for i in layers], dim=-1)  # [B, T, m*d]
    cache = None
    if use_cache:
        cache = out["cache"] if "cache" in out.keys() else out.past_key_values
    return Capture(hidden=hidden, final=out.last_hidden_state, past_key_values=cache)


def capture_layers(model: Any, input_ids: torch.Tensor | list[int], layers: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence [T] → (hidden_states [T, m*d], final_hidden [T, d]) in the model's dtype/device."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]  # [1, T]
    cap = capture_batch(model, ids, layers)
    return cap.hidden[0], cap.final[0]


def capture_step(model: Any, new_ids: torch.Tensor | list[int], layers: list[int],
                 past_key_values: Any = None) -> Capture:
    """Incremental capture for decoding: feed only new tokens, keep the KV cache (eval's helper)."""
    ids = torch.as_tensor(new_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]  # [1, t]
    if past_key_values is None:
        past_key_values = new_cache(model.config)
    cap = capture_batch(model, ids, layers, past_key_values=past_key_values, use_cache=True)
    return Capture(hidden=cap.hidden[0], final=cap.final[0], past_key_values=cap.past_key_values)


def answer_sample(model: Any, sample_id: str, prompt_ids: list[int], answer_ids: list[int],
                  eos_id: int, layers: list[int]) -> Sample:
    """prompt + answer + eos → one training sample in the cache reader's format, without a cache.

    Supervised (loss_mask) on the answer and its eos only, features stored as bf16 as `cache build`
    stores them; what self-distillation in benchmarks and test fixtures feeds the trainer.
    """
    ids = prompt_ids + answer_ids + [eos_id]
    hidden, final = capture_layers(model, ids, layers)
    mask = torch.tensor([0] * len(prompt_ids) + [1] * (len(answer_ids) + 1), dtype=torch.bool)
    return Sample(sample_id, torch.tensor(ids), mask, hidden.to(torch.bfloat16),
                  final[mask].to(torch.bfloat16))  # [K, d]: the answer's positions only
