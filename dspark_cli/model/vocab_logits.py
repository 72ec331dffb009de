"""A draft round's vocabulary-wide logits, `h @ Wᵀ` for a handful of rows, at the speed the CPU allows.

A draft round multiplies γ rows (R·γ with R requests) by the frozen [V, d] lm_head. In float32 on
a CPU, MKL's `F.linear` (the `x · Wᵀ` form) reads the weight at ~5 GB/s for so few rows, where the
same product written `W · xᵀ` streams it 2-4x faster: on a 2-core AVX2 VM, SmolLM2's [49152, 576]
weight and 7 rows took 25.9 ms against 9.5 ms (1 row: 8.2 against 7.9). Past about a dozen rows,
or in bf16 (oneDNN's kernels, already near the memory bandwidth on AMX), `F.linear` stays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Rows up to which the `W · xᵀ` form is used (measured faster for 2-11 rows, slower for 13-15).
FEW_ROWS = 11


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [M, d] → logits [M, V] with weight [V, d]; the same values as `F.linear`."""
    if hidden.device.type == "cpu" and weight.dtype == torch.float32 and 1 < hidden.shape[0] <= FEW_ROWS:
        return (weight @ hidden.t()).t()
    return F.linear(hidden, weight)
