"""Resumable checkpoints on any fsspec URL: a directory committed by a marker written last.

    {url}/checkpoints/step-00000500/   model.safetensors, drafter_config.json, optimizer.pt,
                                       trainer_state.json, rng-rank{r}.pt, _COMMITTED
    {url}/checkpoints/latest           "step-00000500" (written after the commit)

A kill at any moment leaves either a committed directory or one without a marker, which resume
ignores and rotation removes. `latest` is a hint; the newest committed directory wins.
"""

from __future__ import annotations

import io
import pickle
import random
from typing import Any

import numpy as np
import torch
from rich.markup import escape

from .. import storage
from ..console import console
from ..errors import DsparkError, reading
from ..manifest import read_manifest
from ..model.drafter import DSparkDrafter
from ..model.export import resolve_drafter_url, save_weights

CHECKPOINTS = "checkpoints"
LATEST = "latest"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoints_url(url: str) -> str:
    return storage.join(url, CHECKPOINTS)


def unrefit_note(url: str) -> str | None:
    """Why a run's checkpoint drafts like its export but is not calibrated like it: the export carries
    the held-out confidence-bias refit (train.fit_confidence_bias), fitted after the last checkpoint
    was saved. None for anything but a checkpoint of a run that recorded a refit."""
    root, sep, _ = url.rstrip("/").rpartition(f"/{CHECKPOINTS}/")
    if not sep:
        return None
    try:
        recorded = read_manifest(root) or {}
    except (DsparkError, ValueError):  # a damaged run record: the note is advice, never a failure
        return None
    bias = (recorded.get("extra") or {}).get("confidence_bias") or {}
    if "shift" not in bias:
        return None
    return (f"{url} has the confidence head from before its run's held-out bias refit "
            f"({bias['shift']:+.3f}), which {storage.join(root, 'export')} carries; pass {root} for the "
            "refit head (its confidences, and a calibration fitted on them, differ).")


def say_if_unrefit(drafter: str) -> None:
    """The one note line export, calibrate and eval print for such a checkpoint (any drafter path)."""
    if note := unrefit_note(resolve_drafter_url(drafter)):
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)


def _save_torch(url: str, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    storage.write_bytes(url, buf.getvalue())


def _load_torch(url: str) -> Any:
    data = storage.read_bytes(url)
    with reading(url, (ValueError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError)):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(url: str, step: int, rank: int) -> None:
    """Every rank writes its own RNG state into the (not yet committed) step directory."""
    _save_torch(storage.join(checkpoints_url(url), step_name(step), f"rng-rank{rank}.pt"), rng_state())


def save_checkpoint(url: str, step: int, drafter: DSparkDrafter, optimizer: torch.optim.Optimizer,
                    scheduler: Any, state: dict[str, Any], keep_last: int) -> str:
    """Rank 0: weights, optimizer, scheduler, trainer state; commit; point `latest`; rotate."""
    ckpt = storage.join(checkpoints_url(url), step_name(step))
    save_weights(drafter, ckpt)
    _save_torch(storage.join(ckpt, "optimizer.pt"), {"optimizer": optimizer.state_dict(),
                                                     "scheduler": scheduler.state_dict()})
    storage.write_json(storage.join(ckpt, "trainer_state.json"), {"step": step, **state})
    storage.commit(ckpt, {"step": step})
    storage.write_text(storage.join(checkpoints_url(url), LATEST), step_name(step) + "\n")
    rotate(url, keep_last)
    return ckpt


def committed_steps(url: str) -> list[int]:
    root = checkpoints_url(url)
    steps = []
    for name in storage.listdir(root):
        if name.startswith("step-") and storage.is_committed(storage.join(root, name)):
            steps.append(int(name.removeprefix("step-")))
    return sorted(steps)


def latest_checkpoint(url: str) -> str | None:
    """URL of the newest committed checkpoint, or None."""
    steps = committed_steps(url)
    return storage.join(checkpoints_url(url), step_name(steps[-1])) if steps else None


def rotate(url: str, keep_last: int) -> None:
    """Keep the newest keep_last committed checkpoints; drop older ones and uncommitted leftovers."""
    root = checkpoints_url(url)
    steps = committed_steps(url)
    keep = {step_name(s) for s in steps[-keep_last:]}
    newest = steps[-1] if steps else -1
    for name in storage.listdir(root):
        if not name.startswith("step-") or name in keep:
            continue
        committed = storage.is_committed(storage.join(root, name))
        if committed or int(name.removeprefix("step-")) < newest:
            storage.remove(storage.join(root, name))


def load_checkpoint(ckpt_url: str, drafter: DSparkDrafter, optimizer: torch.optim.Optimizer,
                    scheduler: Any, rank: int) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and this rank's RNG; return the trainer state.

    Every file is read (and so checked) before anything is applied: a damaged file raises a
    DsparkError naming it and leaves the drafter and optimizer untouched."""
    from safetensors.torch import load as st_load

    weights_url = storage.join(ckpt_url, "model.safetensors")
    with reading(weights_url):
        weights = st_load(storage.read_bytes(weights_url))
    opt = _load_torch(storage.join(ckpt_url, "optimizer.pt"))
    rng_url = storage.join(ckpt_url, f"rng-rank{rank}.pt")
    rng = _load_torch(rng_url) if storage.exists(rng_url) else None
    state_url = storage.join(ckpt_url, "trainer_state.json")
    state = storage.read_json(state_url)
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise DsparkError(f"{state_url}: damaged (no integer 'step').")
    with reading(storage.join(ckpt_url, "optimizer.pt"), (ValueError, KeyError, RuntimeError)):
        drafter.load_state_dict(weights, strict=False)
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
    if rng is not None:
        set_rng_state(rng)
    return state


def resume_checkpoint(url: str, drafter: DSparkDrafter, optimizer: torch.optim.Optimizer,
                      scheduler: Any, rank: int) -> tuple[str, dict[str, Any]] | None:
    """Load the newest committed checkpoint that reads back whole; (its URL, trainer state), or None.

    A damaged newer one (a disk fault, a truncated copy) is skipped with a line naming it and why,
    rather than blocking every rerun while an older intact checkpoint of the same run exists."""
    skipped: list[str] = []
    for step in reversed(committed_steps(url)):
        ckpt = storage.join(checkpoints_url(url), step_name(step))
        try:
            return ckpt, load_checkpoint(ckpt, drafter, optimizer, scheduler, rank)
        except DsparkError as e:
            skipped.append(step_name(step))
            console.print(f"[yellow]![/] train: skipping checkpoint {escape(ckpt)}: {escape(str(e))}",
                          highlight=False, soft_wrap=True)
    if skipped:
        raise DsparkError(f"{checkpoints_url(url)}: every checkpoint is damaged ({', '.join(skipped)}).",
                          hint="rerun with --force to train from the start.")
    return None
