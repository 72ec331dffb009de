"""[eval]: speculative decoding with the real target (`dspark eval`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import Section


@dataclass
class EvalSettings(Section):
    name = "eval"
    input_paths = {"datasets": "paths", "drafter": "path", "sps": "path", "calibration": "path"}
    #: `{"turns": [...]}` JSONL files or prompt/response artifact URLs.
    datasets: list[str] = field(default_factory=list)
    #: Drafter: a train artifact, checkpoint dir or export folder ("" = pipeline.work_dir/train).
    drafter: str = ""
    #: Conversations per dataset (None: all).
    limit: int | None = None
    max_new_tokens: int = 256
    #: Sampling temperature of target and drafter; 0 is greedy.
    temperature: float = 1.0
    thinking: bool = False
    #: fixed, threshold, algorithm1 or async.
    schedule: str = "fixed"
    #: Requests decoded together per round (the scheduler decides jointly for them).
    concurrency: int = 1
    #: Extra concurrencies to rerun with the same schedule, for budget-per-request vs R (Fig. 8).
    concurrency_sweep: list[int] = field(default_factory=list)
    #: Prefix-survival cut of the `threshold` schedule.
    threshold: float = 0.5
    #: Thresholds of the static-threshold sweep (Fig. 5).
    sweep_thresholds: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6,
                                                                   0.7, 0.8, 0.9])
    #: SPS table (`dspark profile`) for algorithm1/async and Θ; "" = constant SPS.
    sps: str = ""
    #: STS calibration JSON (`dspark calibrate`) applied to confidences; "" = raw.
    calibration: str = ""
    #: Also decode the prompts with the target alone, for the tokens/s comparison.
    baseline: bool = True
    #: Candidates per slot the drafter's Markov bias is applied to; the draft distribution is the
    #: softmax over them (exact for verification). 0 = the whole vocabulary (slower on CPU).
    draft_top_k: int = 64
    #: Split of a prompt/response artifact dataset (None: all rows).
    split: str | None = None
    seed: int = 0

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            self.fail("max_new_tokens", f"must be > 0, got {self.max_new_tokens}.")
        if self.temperature < 0:
            self.fail("temperature", f"must be >= 0, got {self.temperature}.")
        if self.schedule not in ("fixed", "threshold", "algorithm1", "async"):
            self.fail("schedule", f"must be fixed, threshold, algorithm1 or async, got {self.schedule!r}.")
        if self.limit is not None and self.limit <= 0:
            self.fail("limit", f"must be > 0, got {self.limit}.")
        if self.concurrency <= 0 or any(r <= 0 for r in self.concurrency_sweep):
            self.fail("concurrency", "must be > 0 (and so must every eval.concurrency_sweep entry).")
        if not 0.0 <= self.threshold <= 1.0:
            self.fail("threshold", f"must be in [0, 1], got {self.threshold}.")
        if any(not 0.0 <= t <= 1.0 for t in self.sweep_thresholds):
            self.fail("sweep_thresholds", "must all be in [0, 1].")
        if self.draft_top_k < 0:
            self.fail("draft_top_k", f"must be >= 0 (0 = whole vocabulary), got {self.draft_top_k}.")
        if self.split not in (None, "train", "validation"):
            self.fail("split", f"must be train or validation, got {self.split!r}.")
