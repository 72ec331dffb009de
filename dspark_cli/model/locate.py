"""Where a drafter lives and what it is, from its folder's JSON alone (no torch).

A checkpoint dir holds `drafter_config.json`; an export folder holds `config.json` with the
DrafterConfig under a private key; a train artifact root holds either below it. Stages read γ and
the target layers from here before any model loads, so a wrong path fails in well under a second.
"""

from __future__ import annotations

from .. import storage
from ..errors import DsparkError, reading
from .config import DrafterConfig

CHECKPOINT_CONFIG = "drafter_config.json"
#: Where an export's config.json keeps the DrafterConfig (engines ignore it); the legacy key is
#: read for exports of earlier releases.
PRIVATE_KEY = "dspark_cli_config"
LEGACY_PRIVATE_KEY = "dspark_config"


def read_config(url: str) -> DrafterConfig:
    """DrafterConfig of a checkpoint dir or an export folder."""
    if storage.exists(storage.join(url, CHECKPOINT_CONFIG)):
        config_url = storage.join(url, CHECKPOINT_CONFIG)
        with reading(config_url, (ValueError, KeyError, TypeError)):  # TypeError: keys missing
            return DrafterConfig.from_json(storage.read_text(config_url))
    if storage.exists(storage.join(url, "config.json")):
        cfg = storage.read_json(storage.join(url, "config.json"))
        private = cfg.get(PRIVATE_KEY, cfg.get(LEGACY_PRIVATE_KEY))
        if not isinstance(private, dict):
            raise DsparkError(f"{url}/config.json has no {PRIVATE_KEY}; it was not exported by dspark.")
        return DrafterConfig.from_dict(private)
    missing = "does not exist" if not storage.exists(url) else \
        f"is neither a dspark checkpoint ({CHECKPOINT_CONFIG}) nor an export (config.json)"
    raise DsparkError(f"drafter {url}: {missing}.",
                      hint="pass a train artifact, checkpoint or export folder "
                           "(<work_dir>/train is what `dspark train` writes).")


def resolve_drafter_url(url: str) -> str:
    """Accept a train artifact root too: its export/, else its latest checkpoint."""
    if any(storage.exists(storage.join(url, name)) for name in (CHECKPOINT_CONFIG, "config.json")):
        return url
    if storage.exists(storage.join(url, "export", "config.json")):
        return storage.join(url, "export")
    latest = storage.join(url, "checkpoints", "latest")
    if storage.exists(latest):
        return storage.join(url, "checkpoints", storage.read_text(latest).strip())
    return url
