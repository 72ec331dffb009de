"""Online training: the frozen target computes each sample's features inside the training loop.

    source = OnlineSource(cfg, "runs/x/responses")
    train(cfg, "runs/x/responses", "runs/x/train", open_split=source.open)    # `dspark train --online`

No cache is written or read. The responses are rendered with the functions `cache build` uses
(target/samples.py: template, loss mask, truncation, skip rules), so sample i online is sample i
of a cache built from the same responses: kept rows in input order, split by their `split`
column. Features are rounded to bf16 as the cache stores them, so the anchors, blocks and loss
are the same too (up to the kernels' reduction order when equal-length samples share a forward).

The target sits on the drafter's device, frozen, under `inference_mode`, in `target.dtype`.
Under torchrun every rank loads its own copy; rank r renders rows r, r+w, … once to decide which
rows are kept (the index is gathered, so every rank agrees on it) and then forwards only the
samples the step plan gives it, exactly the ones it would read from a cache. Each sample is
rendered again when it is used: the index holds row numbers, not tokens, so host memory does
not grow with the dataset.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from .. import manifest
from ..config import PipelineConfig
from ..console import console
from ..errors import DsparkError
from ..sample import Sample
from ..target import identity
from ..target.dtypes import resolve_device
from ..target.files import hidden_size, load_config, num_layers
from ..target.layers import resolve_layers
from ..target.model import Target, load_tokenizer
from ..target.samples import forward_samples, read_response_rows, skip_reason

SOURCE = "online"


class OnlineSource:
    """The responses and the loaded target, shared by the train and validation splits."""

    def __init__(self, cfg: PipelineConfig, responses_url: str, quiet: bool = False) -> None:
        self.cfg, self.url, self.quiet = cfg, responses_url, quiet
        self.tokenizer: Any = None
        self.target: Target | None = None  # the weights load on the first forward (a finished run needs none)
        self.layers: list[int] = []
        self._meta: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.kept: list[tuple[int, str]] = []  # (row number, split) of every sample, in input order
        self.skipped: dict[str, int] = {}
        self.forward_seconds = 0.0
        self.forward_tokens = 0
        self._stream: Any = None

    # -- set-up ---------------------------------------------------------------------------------

    def _load(self) -> None:
        """Rows, tokenizer, config and the sample index (no weights)."""
        if self.tokenizer is not None:
            return
        t = self.cfg.target
        rank, world = _rank_world()
        device = self.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's object gather below uses the current device
        manifest.require_artifact(self.url, "data.regen", "--responses", "pass the output of `dspark data "
                                  "regen` (default <work_dir>/responses) as --responses.")
        if manifest.read_manifest(self.url) is None and rank == 0 and not self.quiet:
            console.print(f"[yellow]warning:[/] {self.url} has no manifest.json: is `dspark data regen` "
                          "still running? Training uses only the rows present now.")
        self.rows = list(read_response_rows(self.url))
        if not self.rows:
            raise DsparkError(f"{self.url}: no responses to train on (0 rows).",
                              hint="run `dspark data regen` until it answers some prompts.")
        config = load_config(t.model, t.revision, t.trust_remote_code)
        self.tokenizer = load_tokenizer(t.model, t.revision, t.trust_remote_code)
        self.layers = resolve_layers(t.layers, num_layers(config), "target.layers")
        self._meta = {"source": SOURCE, "target": t.model, "layers": self.layers,
                      "hidden_size": hidden_size(config), "target_config_hash": identity.config_hash(config)}
        started = time.perf_counter()
        mine, skipped = self._index_share(rank, world)
        shares: list[Any] = [(mine, skipped)]
        if world > 1:
            shares = [None] * world
            dist.all_gather_object(shares, (mine, skipped))
        for part, counts in shares:
            self.kept += part
            for reason, n in counts.items():
                self.skipped[reason] = self.skipped.get(reason, 0) + n
        self.kept.sort()
        if rank == 0 and not self.quiet:
            console.print(f"online: {len(self.kept)} samples from {len(self.rows)} responses (skipped: "
                          f"{self.skipped or 'none'}), indexed in {time.perf_counter() - started:.1f}s; "
                          f"the target runs on {device} in {t.dtype}.")

    @property
    def device(self) -> torch.device:
        """The drafter's device: the target sits beside it (this rank's GPU under torchrun)."""
        return resolve_device(self.cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))

    def _model(self) -> Target:
        if self.target is None:
            t = self.cfg.target
            self.target = Target.load(t.model, t.dtype, str(self.device), t.trust_remote_code, t.revision)
        return self.target

    def _index_share(self, rank: int, world: int) -> tuple[list[tuple[int, str]], dict[str, int]]:
        """Render rows rank, rank+world, …: which become samples (and their split), which are skipped."""
        c = self.cfg.cache
        kept: list[tuple[int, str]] = []
        skipped: dict[str, int] = {}
        for r in range(rank, len(self.rows), world):
            sample, reason = skip_reason(self.tokenizer, self.rows[r], c.max_length, c.min_loss_tokens)
            if sample is None:
                skipped[reason] = skipped.get(reason, 0) + 1
            else:
                kept.append((r, sample.split))
        return kept, skipped

    def open(self, split: str) -> OnlineDataset:
        """The `split` samples ("train" or "validation"), featured on demand."""
        self._load()
        return OnlineDataset(self, [r for r, sp in self.kept if sp == split])

    # -- features -------------------------------------------------------------------------------

    @property
    def meta(self) -> dict[str, Any]:
        """What the trainer checks a dataset against (the keys a cache manifest has)."""
        return dict(self._meta)

    def featured(self, rows: list[int]) -> list[Sample]:
        """Render rows and run the target over them (equal lengths share a forward)."""
        target = self._model()
        c = self.cfg.cache
        samples = []
        for r in rows:
            sample, reason = skip_reason(self.tokenizer, self.rows[r], c.max_length, c.min_loss_tokens)
            if sample is None:  # rendering is deterministic: the index pass kept this row
                raise DsparkError(f"{self.url}: row {r} rendered differently than at start ({reason}).")
            samples.append(sample)
        started = time.perf_counter()
        with self._on_side_stream():
            self.forward_tokens += forward_samples(target.model, samples, self.layers, c.batch_tokens)
        self.forward_seconds += time.perf_counter() - started
        return samples

    def _on_side_stream(self) -> Any:
        """On CUDA the target runs on its own stream, so it can overlap the drafter's kernels (the
        features are copied to the host before anyone reads them, which waits for that stream)."""
        device = self._model().device
        if device.type != "cuda":
            return nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return torch.cuda.stream(self._stream)

    def report(self) -> dict[str, Any]:
        """What the train manifest records about the online source."""
        return {"source": SOURCE, "responses": self.url, "rows": len(self.rows), "samples": len(self.kept),
                "skipped": dict(self.skipped), "target_forward_seconds": round(self.forward_seconds, 3),
                "target_tokens": self.forward_tokens, "target_dtype": self.cfg.target.dtype}

    def stage_inputs(self) -> dict[str, str]:
        """The train stage's inputs: the responses and the target (its weights are read every step)."""
        t = self.cfg.target
        return {self.url: manifest.fingerprint(self.url),
                t.model: identity.fingerprint(t.model, t.revision, t.trust_remote_code)}


class OnlineDataset(torch.utils.data.Dataset):
    """One split of an OnlineSource: sample i = the i-th kept row of that split, featured on read."""

    def __init__(self, source: OnlineSource, rows: list[int]) -> None:
        self.source, self.rows = source, rows

    @property
    def meta(self) -> dict[str, Any]:
        return self.source.meta

    @property
    def forward_seconds(self) -> float:
        return self.source.forward_seconds

    def stage_inputs(self) -> dict[str, str]:
        return self.source.stage_inputs()

    def report(self) -> dict[str, Any]:
        return self.source.report()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Sample:
        return self.get_many([i])[0]

    def get_many(self, indices: list[int]) -> list[Sample]:
        """Samples `indices` with one target pass over them (a micro-batch)."""
        for i in indices:
            if not 0 <= i < len(self):
                raise IndexError(f"sample {i} out of range ({len(self)} samples)")
        return self.source.featured([self.rows[i] for i in indices])


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
