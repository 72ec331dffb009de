"""Host-side speed settings that must not change results: glibc keeping freed blocks (train), and
eager attention for CPU speculative decoding (eval)."""

from __future__ import annotations

import subprocess
import sys

import torch

from dspark_cli.target.model import decode_attention, load_target

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

for _ in range(3):  # the heap settles into its layout
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
    # ~150 MB of temporaries a step fault ~5 × 33k pages by default; kept blocks (almost) none.
    default, kept = _faults("default"), _faults("keep")
    assert default > 5 * 20_000
    assert kept < default / 20


def test_decode_attention_switches_cpu_targets_to_eager_with_the_same_logits(tiny_llama_target):
    model, _ = load_target(str(tiny_llama_target), "float32", "cpu")
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, :4] = 0  # a left-padded row, as batched decoding pads them
    with torch.inference_mode():
        sdpa = model(input_ids=ids, attention_mask=attention).logits
        decode_attention(model)
        eager = model(input_ids=ids, attention_mask=attention).logits
    assert model.config._attn_implementation == "eager"
    real = attention.bool()
    torch.testing.assert_close(eager[real], sdpa[real], rtol=1e-4, atol=1e-4)
