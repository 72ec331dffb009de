"""Where an input path named in a pipeline config points, so a config works from any directory.

- `package://PACKAGE/PATH` names a file shipped inside an installed Python package — the bundled
  prompt and eval sets are `package://dspark_cli/resources/demo_prompts.jsonl` and friends —
  found through importlib.resources wherever dspark is installed.
- A relative input path written in a config file is relative to that file's folder.
- A path given as a flag or `--set` is relative to where the command runs, as at any shell; so
  are `pipeline.work_dir` and every stage output: outputs belong to the run, not to the config.

Which keys are input paths is declared by each settings section (`Section.paths`), with a kind:
"path" (always a path), "paths" (a list of them), "model" (a folder, or a hub id when no such
folder exists next to the config and it does not start with ./ or ../), "source" (a comma list of
files, globs or folders, or a hub dataset id).
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Any

from .data.sources import GLOB_CHARS, LOCAL_SUFFIXES
from .errors import ConfigError

PACKAGE_SCHEME = "package://"


def package_file(url: str) -> str:
    """package://PACKAGE/PATH → that file's path on disk; ConfigError naming the URL otherwise."""
    package, _, inner = url[len(PACKAGE_SCHEME):].partition("/")
    if not package or not inner:
        raise ConfigError(f"{url}: expected package://PACKAGE/PATH, e.g. "
                          "package://dspark_cli/resources/demo_prompts.jsonl.")
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise ConfigError(f"{url}: no installed Python package '{package}'.") from None
    found = root.joinpath(*inner.split("/"))
    if not isinstance(found, Path):  # a zipped install: nothing on disk to hand to the stages
        raise ConfigError(f"{url}: package '{package}' is not installed as files on disk.")
    if not found.exists():
        shipped = sorted(p.name for p in found.parent.iterdir()) if found.parent.is_dir() else []
        more = f"; {found.parent.name}/ holds {', '.join(shipped)}" if shipped else ""
        raise ConfigError(f"{url}: package '{package}' ships no {inner}{more}.")
    return str(found)


def _local(value: str) -> bool:
    """Neither a URL with a scheme nor an absolute path: a path relative to something."""
    return "://" not in value and not os.path.isabs(os.path.expanduser(value))


def _against(base: Path, value: str) -> str:
    return os.path.normpath(base / value)


def resolve(value: str, kind: str, base: Path | None) -> str:
    """One config value of `kind` (see the module doc); `base` is the config file's folder, or None
    for values typed at the command line (those stay relative to the working directory)."""
    if not value:
        return value
    if kind == "source":
        return ",".join(resolve_source_item(v.strip(), base) for v in value.split(",") if v.strip())
    if value.startswith(PACKAGE_SCHEME):
        return package_file(value)
    if base is None or not _local(value):
        return os.path.expanduser(value)
    if kind == "model" and not value.startswith(("./", "../")) and not (base / value).exists():
        return value  # a hub id such as Qwen/Qwen3-4B (or a folder relative to the working dir)
    return _against(base, value)


def resolve_source_item(item: str, base: Path | None) -> str:
    """One item of data.source: package file, local file/glob/folder, or a hub dataset id."""
    if item.startswith(PACKAGE_SCHEME):
        return package_file(item)
    if base is None or not _local(item):
        return os.path.expanduser(item)
    looks_local = (item.startswith(("./", "../")) or any(c in item for c in GLOB_CHARS)
                   or item.endswith(LOCAL_SUFFIXES) or (base / item).exists())
    return _against(base, item) if looks_local else item


def resolve_sections(raw: dict[str, dict[str, Any]], kinds: dict[str, dict[str, str]],
                     base: Path | None) -> None:
    """Resolve, in place, every declared input path of a raw config (TOML tables)."""
    for section, keys in kinds.items():
        values = raw.get(section)
        if not isinstance(values, dict):
            continue
        for key, kind in keys.items():
            value = values.get(key)
            if kind == "paths" and isinstance(value, list):
                values[key] = [resolve(v, "path", base) if isinstance(v, str) else v for v in value]
            elif kind == "paths" and isinstance(value, str):
                values[key] = [resolve(v.strip(), "path", base) for v in value.split(",") if v.strip()]
            elif isinstance(value, str):
                values[key] = resolve(value, kind, base)
