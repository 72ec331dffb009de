"""Per-rank peak memory of a training step, term by term.

    states       weights fp32 4·P, AdamW moments 8·P, gradients 4·P (freed by zero_grad, so
                 they meet the activations only in the step where AdamW creates its moments)
    frozen       the target's embedding and lm_head (fp32 in the drafter), plus the lm_head and
                 W2 in the matmul dtype (bf16 under autocast), cast once per step
    activations  what autograd saves for one micro-batch: traced by running the real DrafterLoss
                 on FakeTensors at the plan's shapes (no memory, no FLOPs spent), so every saved
                 tensor, autocast's weight copies included, is counted as the trainer makes it
    transient    the vocabulary-wide buffers of one loss chunk (logits, target softmax, gradient)
    batches      the micro-batch in use and the ones prefetched (contexts, target states, mask)
    online       the frozen target in the target dtype and its forward's hidden states
    runtime      the process itself: measured for CPU (torch + libraries), an allowance for CUDA
    checkpoint   a checkpoint's AdamW moments (8·P) serialised in host memory before the write: on
                 CPU that is the device's memory, and `make rehearse` measured it as the peak
    kept         decoded cache samples the reader keeps (train.cache_memory_mb, at most the split):
                 host memory, so on CPU only

    peak = runtime + frozen + batches (+ online | + kept) + max(12·P + activations + transient,
                                                              16·P, 12·P + checkpoint)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..model.config import DrafterConfig

#: The process before any tensor: the interpreter, torch and its libraries (CPU: measured here,
#: `python -c "import torch, transformers"` peak RSS; CUDA: the context the driver takes).
RUNTIME_BYTES = {"cpu": 700 * 2**20, "cuda": 1024 * 2**20}


@dataclass(frozen=True)
class Parameters:
    trainable: int
    frozen: int


def parameter_counts(c: DrafterConfig) -> Parameters:
    """Trainable and frozen (embedding + lm_head) parameter counts of the drafter, exactly."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..model.drafter import DSparkDrafter

    with FakeTensorMode():
        drafter = DSparkDrafter(c)
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in drafter.parameters() if not p.requires_grad)
    return Parameters(trainable, frozen)


def traced_activation_bytes(c: DrafterConfig, samples: list[tuple[int, int]], num_anchors: int,
                            chunk_blocks: int, bf16: bool) -> int:
    """Bytes autograd saves for one micro-batch of `samples` [(tokens, loss tokens)], traced on
    FakeTensors through the trainer's own DrafterLoss (parameters themselves not counted)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..model.attention import dense_mask
    from ..model.drafter import DSparkDrafter
    from ..train.loss import DrafterLoss, LossWeights
    from .batches import synthetic_micro_batch

    batch = synthetic_micro_batch(c, samples, num_anchors)
    mask = dense_mask(batch.layout)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    saved: dict[int, int] = {}
    with mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DrafterLoss keys its lm_head cast on data_ptr()
        drafter = DSparkDrafter(c)
        own = {p.untyped_storage()._cdata for p in drafter.parameters()}
        fake = type(batch)(**{k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v)
                              for k, v in batch.__dict__.items()})
        fake_mask = mode.from_tensor(mask)

        def keep(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in own:
                saved.setdefault(storage._cdata, storage.nbytes())
            return t

        # fast_kernels deduplicates rows by value (data-dependent shapes, which FakeTensors
        # cannot trace); the earlier path saves the same activations within a rank-r feature.
        loss = DrafterLoss(drafter, LossWeights(), chunk_blocks, fast_kernels=False)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
            with autocast:
                loss(fake, fake_mask)
    return sum(saved.values())


def loss_transient_bytes(c: DrafterConfig, blocks: int, chunk_blocks: int, bf16: bool) -> int:
    """One loss chunk's vocabulary-wide buffers: fp32 logits and target softmax, the matmul-dtype
    product being written and the gradient in the matmul dtype."""
    rows = min(blocks, chunk_blocks or blocks) * c.block_size
    half = 2 if bf16 else 4
    return rows * c.vocab_size * (4 + 4 + half + half)


def sample_bytes(c: DrafterConfig, tokens: int, loss_tokens: int) -> int:
    """One decoded cache sample as the reader returns it: ids (int64) and mask (bool) per token,
    the context layers' states (bf16) per token, the final state (bf16) per loss token."""
    return tokens * (8 + 1 + c.num_context_layers * c.hidden_size * 2) + loss_tokens * c.hidden_size * 2


def batch_bytes(c: DrafterConfig, context_tokens: int, blocks: int) -> int:
    """A packed micro-batch on the host/device: context states (bf16), target states, mask."""
    q = blocks * c.block_inputs
    return (context_tokens * c.num_context_layers * c.hidden_size * 2
            + blocks * c.block_size * c.hidden_size * 2 + q * (context_tokens + q))
