"""What identifies a target: one config hash, used by the cache manifest and by stage inputs.

The hash covers the config minus where/how it was saved (same architecture and sizes, same
hash), so re-saving a model elsewhere or with another Transformers version keeps every cache,
eval and calibration valid; hashing GBs of weights on every run would be slow. The chat template
is hashed on its own: a cache is only valid for the template that rendered it.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..manifest import canonical_hash
from .files import load_config, require

#: Config keys that name where or with what a model was saved, not what it computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype",
                         "_commit_hash", "_attn_implementation_autoset", "attn_implementation"}
#: Prefix of a target's stage-input fingerprint (manifest `inputs`).
PREFIX = "target:"


def config_hash(model_or_config: Any) -> str:
    """sha256 of the config without its volatile keys (the cache manifest's `target_config_hash`)."""
    config = getattr(model_or_config, "config", model_or_config)
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return canonical_hash({k: v for k, v in data.items() if k not in _VOLATILE_CONFIG_KEYS})


def fingerprint(target: str, revision: str | None = None, trust_remote_code: bool = False,
                previous: str | None = None) -> str:
    """The target as a stage input: 'target:' + its config hash.

    `previous` is what an earlier run of the stage recorded; when that is the spelling releases
    before this one wrote for the same target (see `legacy_fingerprint`), it is returned as is, so
    their outputs still count as done (or resume) instead of conflicting.
    """
    require(target)
    if previous is not None and not previous.startswith(PREFIX) and previous == legacy_fingerprint(target):
        return previous
    return PREFIX + config_hash(load_config(target, revision, trust_remote_code))


def legacy_fingerprint(target: str) -> str:
    """Eval/calibrate/profile inputs up to 0.x: sha256 of config.json's bytes, or the id itself."""
    from .. import storage

    config = storage.join(target, "config.json")
    if storage.exists(config):
        return "config:" + storage.sha256_bytes(storage.read_bytes(config))
    return "id:" + target


def template_hash(tokenizer: Any) -> str:
    """sha256 of the chat template (the cache manifest's `template_hash`)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = "\n".join(f"{k}:{v}" for k, v in sorted(template.items()))
    return hashlib.sha256((template or "").encode()).hexdigest()
