"""Dtype names and devices: the one table every stage (target, train, export, convert) spells from."""

from __future__ import annotations

from typing import Any

from ..errors import DsparkError

#: Compute/storage dtypes by the name configs and flags use; torch dtypes via `torch_dtype`.
DTYPE_NAMES: tuple[str, ...] = ("bfloat16", "float16", "float32")


def check_dtype(name: str, where: str = "--dtype") -> str:
    """`name` if it is one of DTYPE_NAMES, else a one-line error naming `where`."""
    if name not in DTYPE_NAMES:
        raise DsparkError(f"{where} {name!r}: must be one of {', '.join(DTYPE_NAMES)}.")
    return name


def torch_dtype(dtype: Any, where: str = "--dtype") -> Any:
    """'bfloat16' (or a torch.dtype) → torch.bfloat16."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, check_dtype(dtype, where))


def resolve_device(name: str = "auto", local_rank: int = 0) -> Any:
    """'auto' → cuda when present, else cpu; a bare 'cuda' → this process's GPU (torchrun's LOCAL_RANK)."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise DsparkError(f"--device {name!r}: {str(e).splitlines()[0]}",
                          hint="use auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def auto_dtype(dtype: str, device: Any) -> str:
    """'auto' → bfloat16 on CUDA or a CPU with native bf16 matmuls, else float32; names pass through."""
    if dtype != "auto":
        return check_dtype(dtype)
    return "bfloat16" if getattr(device, "type", device) == "cuda" or cpu_has_fast_bf16() else "float32"


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with native bf16 matmuls (AVX512-BF16/AMX): there bf16 is ~2x faster than fp32."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
