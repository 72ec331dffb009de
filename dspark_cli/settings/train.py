"""[train]: drafter training (`dspark train`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..target.dtypes import DTYPE_NAMES
from .base import Section

SOURCES = ("cache", "online")
#: Where a fresh Markov head's W1 rows start (model/markov_init.py).
MARKOV_INITS = ("random", "embedding")
#: Where a fresh drafter's layers, fc and norms start (model/backbone_init.py).
BACKBONE_INITS = ("random", "target")
#: Keys that change how fast training runs, not what it computes (left out of the stage config).
RUNTIME_KEYS = ("prefetch_batches", "fast_kernels", "compile_vocab", "cache_memory_mb")
#: Keys added after a release, with the value that reproduces it: left out of the stage config at
#: that value, so a run of that release still resumes and is still reused.
EARLIER_BEHAVIOUR = {"init_output_gain": 1.0, "output_norm_lr_scale": 1.0, "fit_confidence_bias": False,
                     "detach_confidence_inputs": False, "markov_lr_scale": 1.0,
                     "markov_init": "random", "backbone_init": "random"}
#: Keys that act only on the confidence head: left out of a headless drafter's stage config (a
#: DFlash baseline's), so adding one never changes those runs.
CONFIDENCE_HEAD_KEYS = ("fit_confidence_bias", "detach_confidence_inputs")
#: Keys that act only on the Markov head: left out of the stage config of a drafter without one.
MARKOV_HEAD_KEYS = ("markov_lr_scale", "markov_init")


@dataclass
class TrainSettings(Section):
    name = "train"
    earlier_behaviour = EARLIER_BEHAVIOUR
    #: Where the target's features come from: "cache" (`dspark cache build`'s output) or "online"
    #: (the target runs in the training loop over the regenerated responses; no cache is built).
    source: str = "cache"
    #: Micro-batches made ahead in a background thread (online: the target's forwards), 0: none.
    prefetch_batches: int = 2
    #: Decoded cache samples kept in memory, up to this many MB: a cache that fits is read and
    #: decoded once instead of every epoch (on 2 cores the reads ran beside each step: the demo's
    #: steps took 1.4-2.0 s, 1.2-1.35 s once every sample was kept). 0: read every time. Speed only.
    cache_memory_mb: int = 2048
    #: Anchors drawn per sequence (without replacement, seeded).
    num_anchors: int = 512
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    #: Samples per optimizer step across all ranks (gradient accumulation fills it).
    global_batch: int = 16
    #: Samples per forward on one rank.
    micro_batch: int = 1
    epochs: int = 1
    #: Stop after this many optimizer steps (None: run the epochs).
    max_steps: int | None = None
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    #: Per-slot loss weight exp(-k / gamma_decay).
    gamma_decay: float = 4.0
    #: Blocks per chunk of the vocabulary-wide loss (0: no chunking).
    loss_chunk_blocks: int = 64
    #: The same loss with less work (train/vocab_fast.py, model/attention.py): target softmaxes and
    #: vanilla Markov biases once per distinct state/token, a prepacked lm_head, reused buffers,
    #: attention over a block's own context only, fused AdamW, and on CPU freed blocks kept by
    #: glibc (train/host_memory.py). false: the earlier kernels (`make bench-train` compares both).
    #: Speed only: left out of the stage config.
    fast_kernels: bool = True
    #: With fast_kernels, the loss chunk's elementwise passes over [rows, V] as one kernel compiled
    #: by TorchInductor (train/vocab_kernel.py): on 2 cores a demo chunk took 107 ms against 179.
    #: "auto": on CPU with bf16 autocast steps where a C++ compiler is found (in fp32 it measured no
    #: faster); true/false: always/never. A kernel that fails to compile falls back to the eager
    #: passes with a warning. Speed only.
    compile_vocab: bool | str = "auto"
    save_every: int = 500
    keep_last: int = 3
    log_every: int = 10
    seed: int = 0
    #: A fresh drafter's final-norm gain: a number, or "auto" (its mask slots' logits start with
    #: the target's logit spread, at most 1). "auto" starts at a far lower loss but trails 1 in τ
    #: from step 50 on at the bench-quality budget (docs/train.md), so 1 stays the default.
    init_output_gain: float | str = 1.0
    #: The final norm's learning rate as a multiple of lr (a low init gain caps every logit until
    #: AdamW, about lr per step, has grown it back).
    output_norm_lr_scale: float = 1.0
    #: The Markov head's vocabulary tables W1 and W2 at this multiple of lr (a gate keeps lr). Each
    #: W1 row learns only on the steps its token comes before a draft slot. On SmolLM2, 10 raised
    #: live τ 6.7% at 111 steps but memorised the training bigrams by 592 and lost 6% there
    #: (docs/train.md), so 1 stays the default.
    markov_lr_scale: float = 1.0
    #: A fresh Markov head's W1 rows: "random" (N(0, 0.02²), the earlier behaviour) or "embedding"
    #: (the target's embedding on its top-r principal directions, same spread), so tokens the target
    #: embeds alike start alike. The export's form is the same either way. On SmolLM2 at 592 steps
    #: live τ ×0.990 (paired 0.962–1.021): noise (docs/train.md), so "random" stays the default.
    markov_init: str = "random"
    #: A fresh drafter's layers: "random" (N(0, 0.02²), the earlier behaviour) or "target": copies of
    #: the target layers after the deepest captured one, fc the identity on that layer's features,
    #: norms (and q/k norm gains) from the target, so the context keys/values of the first layer
    #: start as the target's own (model/backbone_init.py). On SmolLM2 (the demo's cache, 111 steps)
    #: validation τ 1.427 -> 1.486; no held-out gain by the demo's 444 steps (docs/train.md).
    #: Llama/Mistral/Qwen2/Qwen3 targets.
    backbone_init: str = "random"
    #: Fraction of the peak lr the cosine decays to.
    min_lr_ratio: float = 0.1
    #: auto (bf16 autocast on CUDA with bf16 and on CPUs with native bf16 matmuls), bf16, or fp32.
    precision: str = "auto"
    #: auto (cuda when present, else cpu), cpu, cuda, cuda:N. Under torchrun each rank takes its local GPU.
    device: str = "auto"
    #: Samples of the cache's validation split scored at the end of training (0: skip).
    eval_samples: int = 64
    #: Refit the confidence head's bias on those validation samples before exporting: after many
    #: epochs the head states the training set's acceptance, which new prompts do not reach
    #: (train/confidence_bias.py). Needs eval_samples > 0 and a validation split.
    fit_confidence_bias: bool = True
    #: Train the confidence head alone: its inputs (the slot states the lm_head reads, and
    #: W1[x_{k-1}]) are detached, so the BCE does not shape the drafting features. Off: at the
    #: bench-quality budget it raised validation τ 1.5% but live τ within noise (paired interval
    #: 0.98–1.03) and left a less discriminating head (docs/train.md). Serving is unchanged.
    detach_confidence_inputs: bool = False
    #: Weight dtype of the exported serving folder.
    export_dtype: str = "bfloat16"
    #: Also write the frozen embedding and lm_head into the export (engines usually share the target's).
    export_include_embeddings: bool = False

    def validate(self) -> None:
        if self.source not in SOURCES:
            self.fail("source", f"must be one of {', '.join(SOURCES)}, got {self.source!r}.")
        if self.prefetch_batches < 0:
            self.fail("prefetch_batches", f"must be >= 0 (0: no prefetch), got {self.prefetch_batches}.")
        if isinstance(self.compile_vocab, str) and self.compile_vocab != "auto":
            self.fail("compile_vocab", f"must be true, false or \"auto\", got {self.compile_vocab!r}.")
        if self.cache_memory_mb < 0:
            self.fail("cache_memory_mb", f"must be >= 0 (0: keep nothing), got {self.cache_memory_mb}.")
        if self.num_anchors <= 0:
            self.fail("num_anchors", f"must be > 0, got {self.num_anchors}.")
        if self.lr <= 0:
            self.fail("lr", f"must be > 0, got {self.lr}.")
        if not 0 <= self.warmup_ratio < 1:
            self.fail("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}.")
        if self.global_batch <= 0 or self.micro_batch <= 0:
            self.fail("global_batch", "and train.micro_batch must be > 0.")
        if self.max_steps is not None and self.max_steps <= 0:
            self.fail("max_steps", f"must be > 0, got {self.max_steps}.")
        if self.gamma_decay <= 0:
            self.fail("gamma_decay", f"must be > 0, got {self.gamma_decay}.")
        for key in ("ce_weight", "tv_weight", "conf_weight", "weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                self.fail(key, f"must be >= 0, got {getattr(self, key)}.")
        if self.global_batch % self.micro_batch:
            self.fail("global_batch", f"({self.global_batch}) must be a multiple of train.micro_batch "
                      f"({self.micro_batch}).")
        if self.epochs <= 0:
            self.fail("epochs", f"must be > 0, got {self.epochs}.")
        if self.loss_chunk_blocks < 0:
            self.fail("loss_chunk_blocks", f"must be >= 0 (0: no chunking), got {self.loss_chunk_blocks}.")
        if self.save_every <= 0 or self.log_every <= 0:
            self.fail("save_every", "and train.log_every must be > 0.")
        if self.eval_samples < 0:
            self.fail("eval_samples", f"must be >= 0, got {self.eval_samples}.")
        if self.keep_last <= 0:
            self.fail("keep_last", f"must be > 0, got {self.keep_last}.")
        if not 0 <= self.min_lr_ratio <= 1:
            self.fail("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}.")
        if self.precision not in ("auto", "bf16", "fp32"):
            self.fail("precision", f"must be auto, bf16 or fp32, got {self.precision!r}.")
        if isinstance(self.init_output_gain, str) and self.init_output_gain != "auto":
            self.fail("init_output_gain", f"must be \"auto\" or a number, got {self.init_output_gain!r}.")
        if isinstance(self.init_output_gain, float) and not 0 < self.init_output_gain <= 10:
            self.fail("init_output_gain", f"must be in (0, 10], got {self.init_output_gain}.")
        if self.output_norm_lr_scale <= 0:
            self.fail("output_norm_lr_scale", f"must be > 0, got {self.output_norm_lr_scale}.")
        if self.markov_lr_scale <= 0:
            self.fail("markov_lr_scale", f"must be > 0, got {self.markov_lr_scale}.")
        if self.backbone_init not in BACKBONE_INITS:
            self.fail("backbone_init", f"must be {' or '.join(BACKBONE_INITS)}, got {self.backbone_init!r}.")
        if self.backbone_init == "target" and self.init_output_gain != 1.0:
            self.fail("init_output_gain", "must stay 1 with backbone_init = \"target\" (the final norm "
                      f"starts as the target's), got {self.init_output_gain!r}.")
        if self.markov_init not in MARKOV_INITS:
            self.fail("markov_init", f"must be {' or '.join(MARKOV_INITS)}, got {self.markov_init!r}.")
        if self.export_dtype not in DTYPE_NAMES:
            self.fail("export_dtype", f"must be one of {', '.join(DTYPE_NAMES)}, got {self.export_dtype!r}.")
