"""Prepacked linear weights for a frozen target on the CPU: every step faster, multi-token ones most.

A decoding step of one token per sequence is a matrix-vector product (GEMV) that streams each
weight once. A verification step of a few tokens (anchor + drafts), or a server step of a few
sequences, is a GEMM with M = 2…64 rows; on the CPU its library kernel repacks the whole weight
into its blocked layout on every call, and that copy costs more than the multiplication: on a
2-core AVX2 VM SmolLM2-135M's fp32 forward took 73 ms for 1 new token, 110 for 2 and 130 for 8.
Packing each weight once, into oneDNN's layout, lets every call reuse it: 58, 73 and 90 ms
(`make bench-prepack`, docs/eval.md). One row takes the packed kernel too, since it is faster
there as well: the target-only baseline must run the fastest path the target has, or a
speculative speed-up measured against it is inflated.

    packed = prepack_linears(model)   # number of nn.Linear layers now packed (0 where unsupported)

Frozen targets only (the packed copy does not follow later weight updates) and no autograd:
a call that needs a gradient takes the plain path. The packed copy costs the linears' memory
once more, so a model whose copy would take more than half the memory still available is left
plain (an fp32 Qwen3-4B: 16 GB more).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: Where prepacking applies: CPU fp32 everywhere, bf16 where oneDNN has native bf16 kernels
#: (AVX512-BF16/AMX; elsewhere its bf16 linear is refused or a slow fallback). Both measured
#: (`make bench-prepack`, docs/eval.md).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packs_dtype(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of `dtype` (bf16 only with native bf16 kernels)."""
    if dtype not in PACKED_DTYPES:
        return False
    if dtype == torch.bfloat16:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN-packed copy of a frozen [out, in] weight, for `packed_linear` (callers check
    `packs_dtype` first)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by `pack_weight(weight)`; forward only (no autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(torch.nn.Linear):
    """An nn.Linear that multiplies by a oneDNN-packed copy of its frozen weight.

    Installed by swapping the class of an existing module (`prepack_linears`), so its parameters,
    weight tying and state dict are the original's.
    """

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():  # Inductor lowers the plain product its own way; a packed
            return F.linear(x, self.weight, self.bias)  # weight it cannot (model/block_sampler.py)
        return packed_linear(x, self.packed_weight, self.bias)


def prepack_supported(model: Any) -> bool:
    """CPU weights of a dtype this CPU packs, and a torch built with oneDNN."""
    try:
        param = next(model.parameters())
    except StopIteration:
        return False
    return (param.device.type == "cpu" and packs_dtype(param.dtype)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def packed_count(model: torch.nn.Module) -> int:
    """How many of the model's linears are packed (what /health and the tests report)."""
    return sum(isinstance(m, PackedLinear) for m in model.modules())


def available_memory() -> int | None:
    """Bytes the kernel says a new allocation can take without swapping (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def prepack_linears(model: torch.nn.Module, memory: int | None = None) -> int:
    """Pack every plain nn.Linear of a frozen CPU model in place; returns how many (0: unsupported,
    or the packed copies would take more than half of `memory`, default: what is available now)."""
    if not prepack_supported(model):
        return 0
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    needed = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    memory = available_memory() if memory is None else memory
    if memory is not None and needed > memory // 2:
        return 0
    for module in linears:
        module.packed_weight = pack_weight(module.weight)
        module.__class__ = PackedLinear
    return len(linears)
