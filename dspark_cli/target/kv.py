"""The KV cache every decoding loop uses: Transformers' DynamicCache, grown in place.

DynamicCache appends a step's keys/values with `torch.cat`, so every step copies the whole cache of
every layer into fresh memory: for `dspark serve`'s 32 rows of SmolLM2 at 400 positions (60 layer
tensors of [32, 3, 400, 64] bf16) 25.6 ms a step on 2 idle cores, against 0.66 ms written in place.
`GrowingLayer` keeps each layer's keys/values in a buffer with room at the end (doubling when
full) and returns views of it, so a step writes only its new positions.

Everything else that edits a cache (crop, batch_select_indices, the left-padded stacking and
trimming of serve/decode) replaces `keys`/`values` with tensors of its own; the layer notices that
they are no longer a prefix view of its buffer and copies them into a new one at the next update.
The values it returns are the same as DynamicCache's, bit for bit (tests/test_kv.py).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

#: Positions a new buffer holds beyond what it must (a buffer then doubles when full).
MIN_ROOM = 64


def _is_prefix_view(view: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    """True when `view` is buffer[:, :, :n, :] (same memory, strides, batch, heads and width)."""
    return (buffer is not None and view.dim() == 4 and view.data_ptr() == buffer.data_ptr()
            and view.stride() == buffer.stride() and view.shape[:2] == buffer.shape[:2]
            and view.shape[3] == buffer.shape[3] and view.dtype == buffer.dtype)


def append_in_place(view: torch.Tensor, buffer: torch.Tensor | None,
                    new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """view [B, H, n, D] (or empty) + new [B, H, m, D] → (view of n + m positions, its buffer)."""
    length = view.shape[-2] if view.dim() == 4 else 0
    total = length + new.shape[-2]
    if not _is_prefix_view(view, buffer) or total > buffer.shape[-2]:
        capacity = max(total + MIN_ROOM, 2 * length)
        grown = new.new_empty((*new.shape[:2], capacity, new.shape[3]))
        if length:
            grown[:, :, :length] = view
        buffer = grown
    buffer[:, :, length:total] = new
    return buffer[:, :, :total], buffer


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose update writes into preallocated room instead of concatenating."""

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self._key_buffer = append_in_place(self.keys, self._key_buffer, key_states)
        self.values, self._value_buffer = append_in_place(self.values, self._value_buffer, value_states)
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


def plain_layers(cache: Any) -> bool:
    """True when every layer of `cache` is plain full-attention keys/values [B, H, T, D] (what
    stacking and trimming caches edit): DynamicLayer or GrowingLayer, nothing sliding or special."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in (DynamicLayer, GrowingLayer) for layer in layers)


def new_cache(config: Any = None) -> Any:
    """An empty KV cache (a DynamicCache, sized by `config` when given) whose full-attention layers
    grow in place; sliding-window and other special layers are left as Transformers makes them."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
    return cache
