"""The vocabulary-wide elementwise work of a loss chunk as one compiled kernel (train.compile_vocab).

After the matmuls, `vocab_fast` turns the [rows, V] logits into CE, TV and their gradient with
about 25 eager passes over float32 [rows, V] buffers (softmax, gather, difference, norm, sign,
products, the one-hot subtraction, the cast for the backward matmuls). On the 2-core VM those
took ~110 ms of a ~180 ms chunk of the demo's shape ([336, 49152]), the matmuls ~57. Compiled by
TorchInductor into a few vectorised loops that read the bf16 logits and recompute exp instead of
storing it, the same work took ~37 ms: the chunk ~107 ms (`make bench-train` measures the step).

Inductor needs a C++ compiler on CPU. "auto" compiles on CPU where one is found (the first chunk
then waits ~15-30 s for the compile; TorchInductor caches it on disk for later processes); any
failure to compile falls back to the eager kernels with one warning, never ending the run.
"""

from __future__ import annotations

import torch

from ..compiled import CompiledFunction, compiler_found


def _terms(logits: torch.Tensor, bias: torch.Tensor | None, bias_index: torch.Tensor | None,
           target_logits: torch.Tensor, state_index: torch.Tensor, labels: torch.Tensor,
           weight: torch.Tensor, ce_coef: float, tv_coef: float, grad_dtype: torch.dtype | None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """CE and TV per row and ∂(ce_coef·ΣwCE + tv_coef·ΣwTV)/∂logits: `vocab_fast`'s maths.

    logits [R, V] (lm_head·h, the matmul dtype); bias the Markov term added to them, [U, V] with
    bias_index [R] naming each row's (None: no Markov head); target_logits [S, V] of the chunk's
    distinct target states, state_index [R] naming each row's; labels, weight [R]. grad_dtype None:
    no gradient (evaluation).
    """
    x = logits.float()
    if bias is not None:
        x = x + bias[bias_index].float()
    top = x.amax(-1, keepdim=True)
    e = torch.exp(x - top)
    total = e.sum(-1, keepdim=True)
    p = e / total
    ce = (top + total.log() - x.gather(-1, labels[:, None])).squeeze(-1)  # −log p[y]
    diff = p - torch.softmax(target_logits.float(), dim=-1)[state_index]
    tv = 0.5 * diff.abs().sum(-1)
    if grad_dtype is None:
        return ce, tv, None
    w = weight[:, None]
    if tv_coef != 0.0:
        s = torch.sign(diff)
        m = (s * p).sum(-1, keepdim=True)
        grad = p * ((0.5 * tv_coef) * s + (ce_coef - 0.5 * tv_coef * m)) * w
    else:
        grad = p * (ce_coef * w)
    columns = torch.arange(x.shape[-1], device=x.device)
    grad = grad - torch.where(columns[None, :] == labels[:, None], ce_coef * w, 0.0)
    return ce, tv, grad.to(grad_dtype)


def wanted(setting: bool | str, device: torch.device, bf16_steps: bool) -> bool:
    """Whether train.compile_vocab = `setting` compiles: true always, false never, "auto" on CPU
    with bf16 autocast steps (native bf16 matmuls) where a C++ compiler is found. In fp32 on an
    AVX2-only CPU the matmuls dominate and the compiled kernel measured no faster (7.00 against
    6.91 s a bench-train step) while costing its compile and ~0.8 GB; on CUDA it is unmeasured."""
    if isinstance(setting, bool):
        return setting
    return device.type == "cpu" and bf16_steps and compiler_found()


class VocabKernel(CompiledFunction):
    """`_terms` compiled once per process (dynamic row counts); a call returns None once it failed
    to compile: the caller then takes its eager kernels."""

    def __init__(self) -> None:
        super().__init__(_terms, "train.compile_vocab", "the loss kernel")
