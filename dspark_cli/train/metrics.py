"""Training metrics: the console (rich), `metrics.jsonl`, and TensorBoard when installed.

metrics.jsonl is rewritten whole through storage (atomic locally, one PUT on object stores), so a
kill never leaves half a line; on resume the lines after the resumed step are dropped, so every
step appears once.
"""

from __future__ import annotations

import json
from typing import Any

from .. import storage
from ..console import console
from ..schemas import validate

METRICS = "metrics.jsonl"


def _timing(record: dict[str, Any]) -> str:
    """Where the step's time went: the target (online) vs the drafter, and waiting for data."""
    if "drafter_s" not in record:
        return ""
    target = f"  target {record['target_s']:.2f}s" if "target_s" in record else ""
    return f"{target}  drafter {record['drafter_s']:.2f}s  wait {record['data_wait_s']:.2f}s"


class MetricsLog:
    def __init__(self, url: str, resume_step: int = 0, enabled: bool = True) -> None:
        self.url = storage.join(url, METRICS)
        self.enabled = enabled
        self.lines: list[str] = []
        if enabled and resume_step > 0 and storage.exists(self.url):
            for line in storage.read_text(self.url).splitlines():
                if line.strip() and json.loads(line).get("step", 0) <= resume_step:
                    self.lines.append(line)
        self.tb = self._tensorboard(url) if enabled else None

    @staticmethod
    def _tensorboard(url: str) -> Any:
        fs, path = storage.url_to_fs(url)
        if not storage.is_local(fs):
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # tensorboard not installed
            return None
        return SummaryWriter(log_dir=storage.join(path, "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        validate(record, "train_metrics", where=self.url)
        self.lines.append(json.dumps(record, sort_keys=True))
        storage.write_text(self.url, "\n".join(self.lines) + "\n")
        acc = record.get("slot_acceptance") or []
        conf = (f"  bce {record['conf_bce']:.4f}  conf_err {record['conf_error']:.3f}"
                if "conf_bce" in record else "")
        console.print(
            f"step {record['step']:>6}/{record['total_steps']}  loss {record['loss']:.4f}  "
            f"ce {record['ce']:.4f}  tv {record['tv']:.4f}"
            + conf
            + f"  τ {record['accepted_length']:.2f}  acc[0] {acc[0] if acc else float('nan'):.3f}"
            + f"  lr {record['lr']:.2e}  {record['tokens_per_s']:.0f} slots/s"
            + _timing(record)
        )
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self.tb.add_scalar(f"train/{key}", value, record["step"])
            for k, value in enumerate(acc):
                self.tb.add_scalar(f"acceptance/slot{k}", value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
