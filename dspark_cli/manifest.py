"""Stage manifests: what a stage read, with which config, what it wrote. Committed last.

Each stage's output directory holds `_run.json` (config and input fingerprints) and `manifest.json`
(written when it finishes). `prepare_stage` decides, without writing anything, whether the stage is
done (skip), fresh, resuming, or conflicting (refuse without --force). The stage then checks its
inputs and probes what it needs (server, target, drafter) and only then calls `StageRun.claim`,
which writes `_run.json` (and, with --force, removes the old output): a run that fails before
claiming leaves nothing that would refuse the corrected rerun.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from . import __version__, storage
from .errors import DsparkError, StageConflictError
from .schemas import validate

MANIFEST_NAME = "manifest.json"
RUN_NAME = "_run.json"
SCHEMA_VERSION = 1

StageState = Literal["done", "fresh", "resume"]


def canonical_hash(obj: Any) -> str:
    """Hash of sorted-key JSON: equal for equal content, whatever the key order."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def fingerprint(url: str) -> str:
    """Identify an input: its stage manifest's hash if it is an artifact, else its bytes' hash."""
    manifest_url = storage.join(url, MANIFEST_NAME)
    if storage.exists(manifest_url):
        return "manifest:" + storage.sha256_bytes(storage.read_bytes(manifest_url))
    fs, path = storage.url_to_fs(url)
    if fs.isfile(path):
        return "sha256:" + storage.sha256_url(url)
    if fs.isdir(path):
        digest = hashlib.sha256()
        for file in sorted(fs.find(path)):
            if file.rsplit("/", 1)[-1] == "README.md":
                continue  # the export's model card, rewritten by later stages (model/card.py)
            digest.update(file[len(path):].encode())
            digest.update(storage.sha256_url(fs.unstrip_protocol(file)).encode())
        return "tree:" + digest.hexdigest()
    return "id:" + str(url)


def recorded_input(output_url: str, url: str) -> str | None:
    """The fingerprint an earlier run in `output_url` recorded for input `url` (None if none).

    Lets an input whose fingerprint spelling changed between releases recognise its old one.
    """
    run_url = storage.join(output_url, RUN_NAME)
    if not storage.exists(run_url):
        return None
    wanted = storage.canonical(url)
    for u, f in (storage.read_json(run_url).get("inputs") or {}).items():
        if storage.canonical(u) == wanted:
            return f
    return None


def _same(old: Any, new: Any) -> bool:
    """Equal config values; two spellings of one existing local file or folder are equal too
    (`dspark_cli/resources/x.jsonl` run from the repository and the absolute path a config now
    resolves it to), as inputs are compared by location below."""
    if old == new:
        return True
    if isinstance(old, str) and isinstance(new, str):
        where = storage.canonical(old)
        return where == storage.canonical(new) and os.path.isabs(where) and os.path.exists(where)
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return all(_same(a, b) for a, b in zip(old, new, strict=True))
    return False


def _diff_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        out: list[str] = []
        for k in keys:
            out += _diff_keys(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if _same(old, new) else [prefix.rstrip(".")]


@dataclass
class StageRun:
    """A stage in progress: call `finish` with counts to commit its manifest."""

    stage: str
    output_url: str
    config: dict[str, Any]
    inputs: dict[str, str]
    state: StageState
    started: float = field(default_factory=time.time)
    #: --force over an existing output: `claim` removes it first.
    replaces: bool = False
    claimed: bool = False

    @property
    def manifest_url(self) -> str:
        return storage.join(self.output_url, MANIFEST_NAME)

    def claim(self) -> None:
        """Take the output: remove what --force replaces, write `_run.json`. Call it only after every
        input check and probe passed; idempotent, and a no-op for a resumed or finished run."""
        if self.claimed:
            return
        self.claimed = True
        if self.state != "fresh":
            return
        if self.replaces:
            storage.remove(self.output_url)
        spec = {"stage": self.stage, "config": self.config, "inputs": self.inputs, "claimed_at": self.started}
        storage.write_json(storage.join(self.output_url, RUN_NAME), spec)

    def abandon(self, *names: str) -> None:
        """Give up the output of a run that produced nothing usable: remove `names`, keep the rest
        (failure records to read) and mark `_run.json` abandoned, so the next run replaces the
        folder whatever its config, without --force. Nothing left to read: no trace at all."""
        for name in names:
            storage.remove(storage.join(self.output_url, name))
        run_url = storage.join(self.output_url, RUN_NAME)
        if not [n for n in storage.listdir(self.output_url) if n != RUN_NAME]:
            storage.remove(run_url)
            return
        spec = {"stage": self.stage, "config": self.config, "inputs": self.inputs, "abandoned": True}
        storage.write_json(run_url, spec)

    def finish(self, counts: dict[str, Any], extra: dict[str, Any] | None = None,
               timings: dict[str, float] | None = None) -> dict[str, Any]:
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "stage": self.stage,
            "tool_version": __version__,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "inputs": [{"url": k, "fingerprint": v} for k, v in sorted(self.inputs.items())],
            "config": self.config,
            "config_hash": canonical_hash(self.config),
            "counts": counts,
            "timings": {"wall_seconds": round(time.time() - self.started, 3), **(timings or {})},
            "extra": extra or {},
        }
        self.claim()
        validate(manifest, "stage_manifest", where=self.manifest_url)
        storage.write_json(self.manifest_url, manifest)
        return manifest


def read_manifest(output_url: str) -> dict[str, Any] | None:
    url = storage.join(output_url, MANIFEST_NAME)
    if not storage.exists(url):
        return None
    try:
        manifest = storage.read_json(url)
    except DsparkError as e:  # not UTF-8 or not JSON: damaged, since dspark writes it whole
        if not isinstance(e.__cause__, UnicodeDecodeError | json.JSONDecodeError):
            raise
        raise DsparkError(f"{str(e).rstrip('.')}; dspark writes it whole, so it is damaged.",
                          hint=f"rerun the stage that wrote {output_url} (--force replaces it).") from e
    validate(manifest, "stage_manifest", where=url)
    return manifest


def prepare_stage(stage: str, output_url: str, config: dict[str, Any], inputs: dict[str, str],
                  force: bool = False) -> StageRun:
    """Decide done / fresh / resume for a stage; refuse a changed config unless force. Writes nothing.

    `inputs` maps input URL to its fingerprint (see `fingerprint`). With force, the old output is
    removed when the run is claimed and the stage starts fresh.
    """
    storage.check_output(output_url, list(inputs))
    run_url = storage.join(output_url, RUN_NAME)
    previous = storage.read_json(run_url) if storage.exists(run_url) else None
    if previous is not None and previous.get("abandoned"):
        return StageRun(stage, output_url, config, inputs, "fresh", replaces=True)
    if previous is not None and not force:
        config_keys = tuple(_diff_keys(previous.get("config"), config))
        differing = [f"config key {k}" for k in config_keys]
        # compare locations, not spellings (`runs/x` and `/abs/runs/x` are one input); name the
        # input the way the user wrote it this time
        old_raw = previous.get("inputs") or {}
        spelled = {storage.canonical(u): u for u in [*old_raw, *inputs]}
        old_inputs = {storage.canonical(u): f for u, f in old_raw.items()}
        new_inputs = {storage.canonical(u): f for u, f in inputs.items()}
        differing += [f"input {spelled[url]}" for url in sorted(set(old_inputs) | set(new_inputs))
                      if old_inputs.get(url) != new_inputs.get(url)]
        if previous.get("stage") != stage:
            differing.insert(0, f"stage ({previous.get('stage')})")
        if differing:
            more = f" and {len(differing) - 4} more" if len(differing) > 4 else ""
            shown = ", ".join(differing[:4]) + more
            raise StageConflictError(
                f"{output_url}: holds a '{previous.get('stage')}' run made with another {shown}.",
                hint="rerun with --force to replace it, or choose another output URL.",
                config_keys=config_keys,
            )
    if force and previous is not None:
        return StageRun(stage, output_url, config, inputs, "fresh", replaces=True)
    if previous is None:
        _refuse_foreign_folder(output_url, force)
        return StageRun(stage, output_url, config, inputs, "fresh")
    if read_manifest(output_url) is not None:
        return StageRun(stage, output_url, config, inputs, "done")
    return StageRun(stage, output_url, config, inputs, "resume")


def _refuse_foreign_folder(output_url: str, force: bool) -> None:
    """A non-empty folder that no stage claimed is someone's data: never write (or later remove)
    stage files in it unless --force says so."""
    if force:
        return
    names = [n for n in storage.listdir(output_url) if not n.startswith(storage.TMP_PREFIX)]
    if names:
        shown = ", ".join(names[:3]) + (" …" if len(names) > 3 else "")
        raise StageConflictError(f"{output_url}: folder is not empty ({shown}) and holds no dspark "
                                 "stage run.",
                                 hint="choose a new or empty output folder.")


def require_artifact(url: str, stage: str, flag: str, hint: str) -> None:
    """Refuse another stage's artifact given where `stage`'s is expected (e.g. prompts as
    --responses), in one line, before anything reads its rows. An unfinished one passes."""
    found = read_manifest(url)
    if found is not None and found.get("stage") != stage:
        raise DsparkError(f"{flag} {url}: is a '{found.get('stage')}' artifact, not a '{stage}' one.",
                          hint=hint)
