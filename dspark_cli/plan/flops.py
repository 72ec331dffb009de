"""FLOPs of one drafter micro-batch, term by term (2 FLOPs a multiply-add).

A micro-batch packs N blocks (n_in slots each, γ draft slots) over C context positions:

    fc            2·C·(m·d)·d           its input (the target's states) needs no gradient
    context K/V   2·C·d·2·kv       per draft layer
    block layers  2·Q·(d·(q + 2kv) + q·d + 3·d·I)   per draft layer, Q = N·n_in
    vocabulary    draft 2·R·d·V, Markov 2·R·r·V, target 2·R·d·V (no gradient), R = N·γ
    attention     4·Q·(C + Q)·q       per draft layer (dense mask: every key is scored)

Backward is twice the forward for what is trained; the frozen lm_head costs one more product
(∂/∂hidden), W2 two (∂/∂z, ∂/∂W2), fc one (its weight only). Attention's backward is 2.5 times
its forward: the fused kernels (flash on CPU and CUDA, flex) recompute the scores rather than save
them, five products of that size (torch's own count of them). On CPU, a bare FlopCounterMode does
not count SDPA's fused kernel, so `counted` leaves attention out there; `flop_counter()` is one
that counts it with torch's own formula for the CUDA kernels, so the whole total can be checked
against a real step on any device (tests/test_plan.py, `make rehearse`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import flop_counter as fc_module

from ..model.config import DrafterConfig


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-batch's forward + backward, by part."""

    fc: int
    context_kv: int
    layers: int
    vocabulary: int
    heads: int
    attention: int

    @property
    def total(self) -> int:
        return self.fc + self.context_kv + self.layers + self.vocabulary + self.heads + self.attention

    def counted(self, device_type: str) -> int:
        """What torch.utils.flop_counter.FlopCounterMode reports for the same step on this device."""
        return self.total - (self.attention if device_type == "cpu" else 0)


def micro_batch_flops(c: DrafterConfig, context_tokens: int, blocks: int) -> StepFlops:
    """Forward + backward FLOPs of one packed micro-batch (C context positions, N blocks)."""
    d, inter, layers, vocab = c.hidden_size, c.intermediate_size, c.num_draft_layers, c.vocab_size
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    C, Q, R = context_tokens, blocks * c.block_inputs, blocks * c.block_size
    r = c.markov_rank if c.markov_head_type != "none" else 0
    fc = 2 * C * c.num_context_layers * d * d * 2  # forward + its weight's gradient
    context_kv = 3 * layers * 2 * C * d * 2 * kv_dim
    block = 2 * Q * (d * (q_dim + 2 * kv_dim) + q_dim * d + 3 * d * inter)
    # draft fwd + ∂hidden and the target's fwd; W2 fwd + ∂z + ∂W2
    vocabulary = (2 * R * d * vocab) * 3 + (2 * R * r * vocab) * 3
    heads = 0
    if c.enable_confidence_head:
        heads += 3 * 2 * R * (d + (r if c.confidence_head_with_markov else 0))
    if c.markov_head_type == "gated":
        heads += 3 * 2 * R * (d + r) * r
    elif c.markov_head_type == "rnn":
        heads += 3 * 2 * R * (2 * r + d) * 3 * r
    attention = layers * (4 + 10) * Q * (C + Q) * q_dim  # forward + backward (scores recomputed)
    return StepFlops(fc, context_kv, 3 * layers * block, vocabulary, heads, attention)


def flop_counter() -> fc_module.FlopCounterMode:
    """FlopCounterMode that also counts CPU's fused SDPA kernel (forward and backward) with torch's
    own attention formulas, the ones it registers for the CUDA flash/efficient kernels."""
    aten = torch.ops.aten
    return fc_module.FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop})


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001, ANN003
    return fc_module.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args,  # noqa: ANN001
                            out_shape=None, **kwargs) -> int:  # noqa: ANN003
    """The CPU kernel's backward takes (grad_out, query, key, value, out, logsumexp, …)."""
    return fc_module.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)
