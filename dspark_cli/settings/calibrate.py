"""[calibrate]: Sequential Temperature Scaling of the confidence head."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section


@dataclass
class CalibrateSettings(Section):
    name = "calibrate"
    #: Held-out prompts used (from the validation split).
    num_prompts: int = 64
    max_new_tokens: int = 128
    temperature: float = 1.0
    #: Temperature grid searched per position.
    t_min: float = 0.05
    t_max: float = 10.0
    t_steps: int = 200
    #: Bins of the expected calibration error.
    ece_bins: int = 15

    def validate(self) -> None:
        if self.num_prompts <= 0:
            self.fail("num_prompts", f"must be > 0, got {self.num_prompts}.")
        if not 0 < self.t_min < self.t_max:
            self.fail("t_min", "must be > 0 and below calibrate.t_max.")
