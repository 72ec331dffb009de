"""A function compiled by TorchInductor where that works, the same function eagerly where not.

Compiling pays where a hot function is many small ops (the draft sampler's slot loop) or many
passes over one big tensor (the loss kernel's vocabulary-wide elementwise work): Inductor fuses
them into a few C++ loops. It needs a C++ compiler on CPU and can fail on an unusual machine, so a
failure is a warning and the eager path, never a failed run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .console import console


def compiler_found() -> bool:
    """A C++ compiler for Inductor's CPU kernels ($CXX, else g++, c++ or clang++ on PATH)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return any(shutil.which(name) for name in names)


class CompiledFunction:
    """`fn` compiled once per process with dynamic shapes. A call returns fn's result, or None once
    compiling failed (then `failed`, one warning naming `setting`, and the caller takes its eager
    path for the rest of the process)."""

    def __init__(self, fn: Callable[..., Any], setting: str, what: str) -> None:
        self.fn, self.setting, self.what = fn, setting, what
        self._compiled: Callable[..., Any] | None = None
        self.failed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed:
            return None
        if _get_current_dispatch_mode() is not None:
            # Under a dispatch mode (FlopCounterMode: bench-train's FLOP count) the same maths
            # eagerly: a compiled function that once ran under one stays ~4x slower afterwards.
            return self.fn(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=True)
        try:
            # Duck sizing would tie two sizes together whenever they happen to be equal (distinct
            # states and tokens, rows and slots): a second, specialised compile later.
            with fx_config.patch(use_duck_shape=False):
                return self._compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 — any compile failure: the eager path is exact
            self.failed = True
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            console.print(f"[yellow]warning:[/] {self.setting}: compiling {self.what} failed "
                          f"({first[:200]}); using the eager kernels (same maths, slower).")
            return None
