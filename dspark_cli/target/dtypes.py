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


#: Overrides the CPU's bf16 detection: "1" (native bf16 matmuls) or "0" (none), e.g. where a VM
#: hides its CPU flags; the test suite pins "0" so its results do not depend on the CI machine.
CPU_BF16_ENV = "DSPARK_CPU_BF16"


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with native bf16 matmuls (AVX512-BF16/AMX): there bf16 is ~2x faster than fp32.

    Elsewhere (AVX2 only) PyTorch's bf16 matmul is a fallback loop: measured 1 GFLOP/s against
    148 in fp32 on a 2-core AVX2 VM, so a bf16 demo there regenerated at 23 tokens/s, not 160."""
    import os

    import torch

    override = os.environ.get(CPU_BF16_ENV)
    if override is not None:
        if override not in ("0", "1"):
            raise DsparkError(f"{CPU_BF16_ENV}={override!r}: must be 1 (native bf16) or 0 (none).")
        return override == "1"
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def bf16_autocast(precision: str, device: Any) -> bool:
    """Whether a `train.precision` runs under bf16 autocast: 'auto' where bf16 matmuls are native."""
    import torch

    if precision != "auto":
        return precision == "bf16"
    if getattr(device, "type", device) == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return cpu_has_fast_bf16()
