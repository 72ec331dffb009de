"""One-token decoding attention on the CPU: each key/value head's query heads as one G-row query.

A step that feeds one token per sequence with no mask (the target-only loop, a verification that
checks no draft, a lone `dspark serve` request) reaches Transformers' SDPA path as
`scaled_dot_product_attention(q [B, H, 1, D], k, v, enable_gqa=True)`. PyTorch's CPU kernel runs
that as H one-row problems and cost 0.10–0.21 ms a layer at 150–400 cached positions (SmolLM2: 9
query heads over 3 key/value heads, bf16, 2-core EPYC), where the same product with the G query
heads of each key/value head stacked as a G-row query, [B, H/G, G, D], cost 0.03: ~3–5 ms of a
~25 ms SmolLM2 step. Transformers stacks them itself only for one token under a mask (`pack_gqa`).
A verification step (q = 2–8 tokens under a mask) reaches SDPA with every key/value head copied G
times (`repeat_kv`): stacked as a G·q-row query with the mask's rows repeated per head instead, it
cost 0.03–0.10 ms a layer against 0.05–0.13. Anything else (long prefills, per-head masks, extra
arguments) goes to Transformers' own SDPA function unchanged. Same maths; the output differs from
the enable_gqa kernel's only in rounding (tests/test_target_decode_attention.py).

    install(model)   # where the model runs "sdpa" on the CPU: the model now runs "dspark_sdpa"
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "dspark_sdpa"

#: Transformers' own SDPA attention function, for every call not stacked here; set by `install`
#: (importing it at module load would pull Transformers into every `dspark` start).
_fallback: Any = None


#: Query tokens per sequence up to which the stacking pays (a verification step: the anchor and its
#: drafts). Longer queries (prefills) keep Transformers' path.
MAX_QUERY = 16


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature: query [B, H, q, D], key/value [B, Hkv, T, D] →
    ([B, q, H, D], None)."""
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    B, H, q, D = query.shape
    if _stackable(query, key, attention_mask, groups, dropout, kwargs):
        mask = attention_mask
        if mask is not None and q > 1:  # stacked row j·q + t is token t of query head j: its mask row is t's
            rows = mask.shape[0]
            mask = mask.expand(rows, groups, q, mask.shape[-1]).reshape(rows, 1, groups * q, -1)
        out = F.scaled_dot_product_attention(query.reshape(B, H // groups, groups * q, D), key, value,
                                             attn_mask=mask, scale=scaling)  # [B, Hkv, G·q, Dv]
        return out.reshape(B, H, q, value.shape[-1]).transpose(1, 2).contiguous(), None
    return _fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)


def _stackable(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, groups: int,
               dropout: float, kwargs: dict[str, Any]) -> bool:
    """A CPU step of at most MAX_QUERY tokens, grouped heads, and nothing but a mask shared by the
    heads (a longer query without a mask is a causal prefill: Transformers' path)."""
    q = query.shape[2]
    if groups <= 1 or key.shape[1] * groups != query.shape[1] or query.device.type != "cpu":
        return False
    if dropout != 0.0 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None \
            or kwargs.get("output_attentions", False):
        return False
    if mask is None:
        return q == 1
    return q <= MAX_QUERY and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == q


def install(model: Any) -> bool:
    """Route a CPU model that runs "sdpa" through `attention` (its masks stay SDPA's); True if it did."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        if next(model.parameters()).device.type != "cpu":
            return False
    except StopIteration:
        return False
    global _fallback
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    _fallback = sdpa_attention_forward
    AttentionInterface.register(NAME, attention)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
