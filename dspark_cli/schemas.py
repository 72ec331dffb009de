"""Load the versioned JSON Schemas in `schemas/` and validate artifacts against them."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

from .errors import DsparkError

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"


def schema_path(name: str) -> Path:
    path = SCHEMA_DIR / f"{name}.schema.json"
    if not path.exists():
        raise DsparkError(f"schema '{name}' not found in {SCHEMA_DIR}.")
    return path


@cache
def load_schema(name: str) -> dict[str, Any]:
    return json.loads(schema_path(name).read_text())


def validate(obj: Any, name: str, where: str = "") -> None:
    """Raise DsparkError naming the artifact and the first violating field."""
    schema = load_schema(name)
    validator = jsonschema.Draft202012Validator(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(obj))
    if error is not None:
        field = "/".join(str(p) for p in error.absolute_path) or "(root)"
        label = where or name
        raise DsparkError(f"{label}: does not match schema '{name}' at {field}: {error.message}")
