"""Where the target's files are and what its config says (no weights are read here).

A local folder is used as is and never touches the hub; anything else is a hub id resolved
through the local Hugging Face cache, downloading only the files asked for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import DsparkError

NO_TARGET_HINT = "pass --target PATH_OR_HUB_ID or set target.model."
LOAD_HINT = ("pass a local folder with config.json + *.safetensors (e.g. from `dspark model convert`), "
             "or a hub id where the hub is reachable.")


def require(target: str) -> str:
    """The target path or id, or the one-line error every stage gives when none is set."""
    if not target:
        raise DsparkError("no target model given.", hint=NO_TARGET_HINT)
    return target


def is_local(target: str) -> bool:
    return os.path.isdir(target)


def looks_like_a_path(target: str) -> bool:
    """A spelling no hub id has (hub ids are `name` or `org/name`)."""
    return target.startswith((".", "/", "~")) or target.count("/") > 1


def hub_kwargs(target: str, revision: str | None = None) -> dict[str, Any]:
    """`revision` / `local_files_only` for from_pretrained, after the checks that make a mistake
    one line at once: a local folder must hold config.json, a missing path is not taken for a hub
    id, and a hub id the hub cannot serve (offline, unreachable) fails now, not after retries."""
    if is_local(require(target)):
        if not os.path.isfile(os.path.join(target, "config.json")):
            raise DsparkError(f"target {target!r}: the folder holds no config.json; it is not a model "
                              "folder.", hint=LOAD_HINT)
        return {"revision": None, "local_files_only": True}
    if looks_like_a_path(target):
        raise DsparkError(f"target {target!r}: no such folder.", hint=LOAD_HINT)
    from .. import hub

    cache_only = hub.access(target, "target", LOAD_HINT, revision=revision)
    return {"revision": revision, "local_files_only": cache_only}


def first_line(e: BaseException, limit: int = 200) -> str:
    """A library's (often multi-line) message as one short line."""
    from ..redact import shorten

    return shorten(str(e), limit) if str(e).strip() else type(e).__name__


def resolve_folder(target: str, files: tuple[str, ...] = ("config.json",),
                   revision: str | None = None) -> Path:
    """A local folder as is; a hub id through the local HF cache (downloads only `files`)."""
    if is_local(require(target)):
        return Path(target)
    hub = hub_kwargs(target, revision)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(target, revision=revision, allow_patterns=list(files),
                                      local_files_only=hub["local_files_only"]))
    except Exception as e:
        raise DsparkError(f"target {target!r}: not a local folder and not fetchable from the hub "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__}).",
                          hint="set target.model to a folder holding config.json and *.safetensors.") from e


def load_config(target: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The target's Transformers config (only config.json is read)."""
    from transformers import AutoConfig

    hub = hub_kwargs(target, revision)
    try:
        return AutoConfig.from_pretrained(target, trust_remote_code=trust_remote_code, **hub)
    except (OSError, ValueError, KeyError) as e:
        raise DsparkError(f"target {target!r}: cannot read its config ({first_line(e)}).",
                          hint="pass --target with a local folder or hub id of a causal LM.") from e


def text_config(model_or_config: Any) -> Any:
    """The language model's config (a multimodal config nests it)."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def num_layers(model_or_config: Any) -> int:
    return int(text_config(model_or_config).num_hidden_layers)


def hidden_size(model_or_config: Any) -> int:
    return int(text_config(model_or_config).hidden_size)
