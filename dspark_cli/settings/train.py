"""[train]: drafter training (`dspark train`)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section


@dataclass
class TrainSettings(Section):
    name = "train"
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
    save_every: int = 500
    keep_last: int = 3
    log_every: int = 10
    seed: int = 0

    def validate(self) -> None:
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
