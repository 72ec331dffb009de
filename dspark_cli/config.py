"""Pipeline TOML + dotted `--set section.key=value` overrides → one typed, validated config.

    cfg = load_config("pipelines/qwen3-4b.toml", ["train.lr=3e-4"])
    cfg.train.lr  # 0.0003

Input paths come back resolved (`paths`): the file's relative ones against its folder,
`package://…` to the installed file; flags, `--set` and pipeline.work_dir stay as typed.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from . import storage
from .errors import ConfigError, reading
from .paths import resolve_sections
from .settings.base import Section
from .settings.cache import CacheSettings
from .settings.calibrate import CalibrateSettings
from .settings.data import DataSettings
from .settings.eval import EvalSettings
from .settings.model import ModelSettings
from .settings.pipeline import PipelineSettings
from .settings.regen import RegenSettings
from .settings.target import TargetSettings
from .settings.train import TrainSettings

SECTIONS: dict[str, type[Section]] = {
    cls.name: cls
    for cls in (PipelineSettings, TargetSettings, DataSettings, RegenSettings, CacheSettings,
                ModelSettings, TrainSettings, CalibrateSettings, EvalSettings)
}


@dataclasses.dataclass
class PipelineConfig:
    """Every section of a pipeline, validated; `to_dict` gives the resolved config for manifests."""

    pipeline: PipelineSettings
    target: TargetSettings
    data: DataSettings
    regen: RegenSettings
    cache: CacheSettings
    model: ModelSettings
    train: TrainSettings
    calibrate: CalibrateSettings
    eval: EvalSettings
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name).to_dict() for name in SECTIONS}

    def stage_url(self, stage_dir: str) -> str:
        """URL of a stage's default output under pipeline.work_dir."""
        return storage.join(self.pipeline.work_dir, stage_dir)


#: Config keys whose repeatable flag is spelled in the singular (`--endpoint URL --endpoint URL`).
_FLAG_OF = {"endpoints": "--endpoint", "datasets": "--dataset"}


def parse_override(text: str) -> tuple[str, str, Any]:
    """'train.lr=3e-4' → ('train', 'lr', value); the value is parsed as TOML when it can be."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value.")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: the key must be section.key, e.g. train.lr.")
    section, key = parts
    if section not in SECTIONS:
        raise ConfigError(f"--set {text!r}: unknown section '{section}'; sections: {', '.join(SECTIONS)}.")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                extra: dict[str, dict[str, Any]] | None = None) -> PipelineConfig:
    """Read a pipeline TOML (or defaults when None), apply `extra` then `--set` overrides."""
    raw: dict[str, Any] = {}
    source = ""
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"{path}: config file not found.")
        if p.is_dir():
            raise ConfigError(f"{path}: is a folder; --config takes a pipeline TOML file.",
                              hint="e.g. --config pipelines/smollm2-135m.toml")
        try:
            with reading(str(path), ()):
                text = p.read_text(encoding="utf-8-sig")  # a UTF-8 BOM (Windows editors) is fine
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e}).") from e
    for name in raw:
        if name not in SECTIONS or not isinstance(raw[name], dict):
            raise ConfigError(f"{path}: unknown section [{name}]; sections: {', '.join(SECTIONS)}.")
    # Where each value came from, so an error blames the file, the flag or the --set that set it.
    origin = {f"{name}.{key}": str(path) for name, values in raw.items() for key in values}
    kinds = {name: cls.input_paths for name, cls in SECTIONS.items()}
    if path is not None:  # the file's own relative paths: against its folder
        try:
            resolve_sections(raw, kinds, Path(path).resolve().parent)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    given: dict[str, dict[str, Any]] = {}
    for section, values in (extra or {}).items():
        flags = {k: v for k, v in values.items() if v is not None}
        given.setdefault(section, {}).update(flags)
        origin.update({f"{section}.{k}": _FLAG_OF.get(k, f"--{k.replace('_', '-')}") for k in flags})
    for text in overrides or []:
        section, key, value = parse_override(text)
        given.setdefault(section, {})[key] = value
        origin[f"{section}.{key}"] = f"--set {text}"
    resolve_sections(given, kinds, None)  # flags and --set: as typed, against the working directory
    for section, values in given.items():
        raw.setdefault(section, {}).update(values)
    try:
        sections = {name: cls.from_dict(raw.get(name, {})) for name, cls in SECTIONS.items()}
    except ConfigError as e:
        raise ConfigError(_blame(str(e), origin)) from None
    return PipelineConfig(**sections, source=source)


def _blame(message: str, origin: dict[str, str]) -> str:
    """Prefix a section error with the source of the key it names (longest key name first)."""
    for key in sorted(origin, key=len, reverse=True):
        if f"{key} " in message or f"'{key}'" in message or f"{key}[" in message:
            return f"{origin[key]}: {message}"
    return message
