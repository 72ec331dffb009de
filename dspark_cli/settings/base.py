"""Typed config sections: TOML tables and `--set` overrides become checked dataclasses.

A section is a dataclass subclassing `Section`. Loading rejects unknown keys and values of the
wrong type with one sentence naming `section.key`; `validate` adds range checks.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, ClassVar, TypeVar, get_args, get_origin

from ..errors import ConfigError

S = TypeVar("S", bound="Section")


@dataclasses.dataclass
class Section:
    """Base for config sections; subclasses set `name` and may override `validate`."""

    name: ClassVar[str] = ""
    #: Keys that name input files, with their kind (`paths.resolve`): a config file's relative
    #: paths resolve against its folder, `package://` against the installed package.
    input_paths: ClassVar[dict[str, str]] = {}
    #: Keys added after a release, with the value that reproduces it: a stage's recorded config
    #: leaves them out at that value (`stage_dict`), so a run of that release still resumes and is
    #: still reused.
    earlier_behaviour: ClassVar[dict[str, Any]] = {}

    def validate(self) -> None:
        """Range checks; raise ConfigError naming the key."""

    def fail(self, key: str, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self.name}.{key} {message}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def stage_dict(self) -> dict[str, Any]:
        """`to_dict` without the keys still at their `earlier_behaviour` value."""
        earlier = self.earlier_behaviour
        return {k: v for k, v in self.to_dict().items() if k not in earlier or v != earlier[k]}

    @classmethod
    def from_dict(cls: type[S], data: dict[str, Any]) -> S:
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ConfigError(
                f"unknown config key '{cls.name}.{unknown[0]}'; known keys in [{cls.name}]: "
                f"{', '.join(sorted(fields))}."
            )
        values = {k: coerce(v, hints[k], f"{cls.name}.{k}") for k, v in data.items()}
        section = cls(**values)
        section.validate()
        return section


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently convert) a TOML or --set value to the annotated type."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key} has value {value!r}, expected {' or '.join(_type_name(a) for a in args)}.")
    if origin is typing.Literal:
        if value not in get_args(tp):
            choices = ", ".join(repr(a) for a in get_args(tp))
            raise ConfigError(f"{key} must be one of {choices}, got {value!r}.")
        return value
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list, got {value!r}.")
        (item_tp, *_) = get_args(tp) or (Any,)
        return [coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {value!r}.")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key} must be true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, got {value!r}.")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be an integer, got {value!r}.")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}.")
        number: float | None = None
        if isinstance(value, int | float):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and not math.isfinite(number):  # nan/inf pass every range check
            raise ConfigError(f"{key} must be a finite number, got {value!r}.")
        if number is not None:
            return number
        raise ConfigError(f"{key} must be a number, got {value!r}.")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}.")
    return value
