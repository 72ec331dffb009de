"""[pipeline]: where a pipeline's artifacts live."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section


@dataclass
class PipelineSettings(Section):
    name = "pipeline"
    #: Human name of the pipeline (used in reports).
    title: str = "dspark"
    #: Root URL of all stage outputs: prompts/, responses/, cache/, train/, calibration/, eval/.
    work_dir: str = "runs/default"
    #: Global seed; stages derive their own seeds from it unless they set one.
    seed: int = 0

    def validate(self) -> None:
        if not self.work_dir:
            self.fail("work_dir", "must not be empty.")
