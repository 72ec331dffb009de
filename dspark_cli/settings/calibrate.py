"""[calibrate]: Sequential Temperature Scaling of the confidence head."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section


@dataclass
class CalibrateSettings(Section):
    name = "calibrate"
    input_paths = {"dataset": "path", "drafter": "path"}
    earlier_behaviour = {"concurrency": 1}
    #: Held-out prompts: a prompt/response artifact ("" = pipeline.work_dir/prompts) or a JSONL file.
    dataset: str = ""
    #: Split of an artifact dataset; calibration must use data the drafter did not train on.
    split: str = "validation"
    #: Drafter: a train artifact, checkpoint dir or export folder ("" = pipeline.work_dir/train).
    drafter: str = ""
    #: Held-out conversations decoded.
    num_prompts: int = 64
    max_new_tokens: int = 128
    #: Held-out conversations decoded together, one batched round for all of them. A round's
    #: confidences and acceptances do not depend on its batch-mates, so this changes the time, not
    #: what STS is fitted on (1 = one at a time, as runs made before this key decoded).
    concurrency: int = 1
    temperature: float = 1.0
    thinking: bool = False
    #: Temperature grid searched per position (geometric, 1.0 included).
    t_min: float = 0.05
    t_max: float = 10.0
    t_steps: int = 200
    #: Bins of the expected calibration error.
    ece_bins: int = 15
    #: A position is fitted only with at least this many accepted and as many rejected prefixes
    #: (fewer: T = 1, the head as trained); docs/eval.md shows the measurement behind 30.
    min_prefixes: int = 30
    seed: int = 0

    def validate(self) -> None:
        if self.num_prompts <= 0:
            self.fail("num_prompts", f"must be > 0, got {self.num_prompts}.")
        if self.max_new_tokens <= 0:
            self.fail("max_new_tokens", f"must be > 0, got {self.max_new_tokens}.")
        if self.concurrency <= 0:
            self.fail("concurrency", f"must be > 0, got {self.concurrency}.")
        if self.temperature < 0:
            self.fail("temperature", f"must be >= 0, got {self.temperature}.")
        if not 0 < self.t_min < self.t_max:
            self.fail("t_min", "must be > 0 and below calibrate.t_max.")
        if self.t_steps < 2:
            self.fail("t_steps", f"must be >= 2, got {self.t_steps}.")
        if self.min_prefixes < 1:
            self.fail("min_prefixes", f"must be >= 1, got {self.min_prefixes}.")
        if self.ece_bins < 2:
            self.fail("ece_bins", f"must be >= 2, got {self.ece_bins}.")
        if self.split not in ("train", "validation"):
            self.fail("split", f"must be train or validation, got {self.split!r}.")
