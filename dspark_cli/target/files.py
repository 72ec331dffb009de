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


def require(target: str) -> str:
    """The target path or id, or the one-line error every stage gives when none is set."""
    if not target:
        raise DsparkError("no target model given.", hint=NO_TARGET_HINT)
    return target


def is_local(target: str) -> bool:
    return os.path.isdir(target)


def resolve_folder(target: str, files: tuple[str, ...] = ("config.json",),
                   revision: str | None = None) -> Path:
    """A local folder as is; a hub id through the local HF cache (downloads only `files`)."""
    if is_local(require(target)):
        return Path(target)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(target, revision=revision, allow_patterns=list(files)))
    except Exception as e:
        raise DsparkError(f"target {target!r}: not a local folder and not fetchable from the hub "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__}).",
                          hint="set target.model to a folder holding config.json and *.safetensors.") from e


def load_config(target: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The target's Transformers config (only config.json is read)."""
    from transformers import AutoConfig

    local = is_local(require(target))
    try:
        return AutoConfig.from_pretrained(target, revision=None if local else revision,
                                          trust_remote_code=trust_remote_code, local_files_only=local)
    except (OSError, ValueError) as e:
        raise DsparkError(f"target {target!r}: cannot read its config ({str(e).splitlines()[0]}).",
                          hint="pass --target with a local folder or hub id of a causal LM.") from e


def text_config(model_or_config: Any) -> Any:
    """The language model's config (a multimodal config nests it)."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def num_layers(model_or_config: Any) -> int:
    return int(text_config(model_or_config).num_hidden_layers)


def hidden_size(model_or_config: Any) -> int:
    return int(text_config(model_or_config).hidden_size)
