"""glibc keeping a training step's freed blocks (train/host_memory.py): they are reused, not
faulted in page by page again."""

from __future__ import annotations

import subprocess
import sys

_FAULTS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from dspark_cli.train.host_memory import keep_freed_memory
    assert keep_freed_memory()

def step():  # the kind of large temporaries a CPU training step makes and frees
    a = torch.randn(448, 49152)
    b = (a * 2).to(torch.bfloat16)
    c = torch.zeros(49152, 256)
    del a, b, c

for _ in range(5):  # the heap settles into its layout
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_kept_blocks_are_reused_without_page_faults():
    # ~150 MB of temporaries a step fault ~5 × 66k pages by default; kept blocks 0-43k in all
    # (measured over four runs: the heap's layout decides how many still move).
    default, kept = _faults("default"), _faults("keep")
    assert default > 5 * 20_000
    assert kept < default / 5
