"""Layer ids (DESIGN.md §3): id i is the output of decoder layer i, Transformers hidden_states[i + 1].

`target.layers` is "auto" or an explicit list. `cache build` resolves it against the target
(`resolve_layers`) and records the result in the cache manifest; from then on the cache (for
train) or the drafter (for calibrate and eval) is the truth, and `agree_layers` refuses only a
user who set other layers explicitly.
"""

from __future__ import annotations

from typing import Any, Literal

from ..errors import ConfigError, DsparkError

AUTO = "auto"
#: What `target.layers` holds once parsed: "auto" or strictly increasing ids >= 0.
LayerSpec = list[int] | Literal["auto"]


def parse_layers(value: Any, where: str = "target.layers") -> LayerSpec:
    """'auto' / a list (from TOML, --set or --layers, already split at commas) → a LayerSpec.

    The one parser: `[]`, `""` and non-integers are one-line config errors naming `where`.
    """
    if isinstance(value, str):
        if value.strip().lower() == AUTO:
            return AUTO
        if not value.strip():
            value = []
        else:
            raise ConfigError(f"{where} {value!r}: expected 'auto' or comma-separated layer ids "
                              "such as 1,9,17,25,33.")
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ConfigError(f"{where} {value!r}: expected 'auto' or a list of layer ids.")
    if not value:
        raise ConfigError(f"{where} is empty: give 'auto' or layer ids such as 1,9,17,25,33.")
    if any(b <= a for a, b in zip(value, value[1:], strict=False)):
        raise ConfigError(f"{where} {value}: ids must be strictly increasing.")
    if value[0] < 0:
        raise ConfigError(f"{where} {value}: ids must be >= 0.")
    return value


def explicit_layers(spec: LayerSpec) -> list[int] | None:
    """The ids a user set, or None for "auto"."""
    return None if spec == AUTO else list(spec)


def auto_layers(num_layers: int, count: int = 5) -> list[int]:
    """`count` ids spread over the depth like the reference configs (36 → 1,9,17,25,33; 40 → 1,10,…,37)."""
    start, end = 1, num_layers - 3
    if count > 1 and end - start >= count - 1:
        span = end - start
        return [int(round(start + i * span / (count - 1))) for i in range(count)]
    # Shallow targets: spread over every layer instead.
    count = min(count, num_layers)
    if count == 1:
        return [num_layers - 1]
    return sorted({int(round(i * (num_layers - 1) / (count - 1))) for i in range(count)})


def resolve_layers(spec: Any, num_layers: int, where: str = "--layers") -> list[int]:
    """"auto" → `auto_layers`; an explicit list checked against the target's depth (the range check)."""
    spec = parse_layers(spec, where)
    if spec == AUTO:
        return auto_layers(num_layers)
    bad = [i for i in spec if i >= num_layers]
    if bad:
        raise DsparkError(f"{where}: id {bad[0]} is out of range; the target has {num_layers} layers "
                          f"(valid ids 0..{num_layers - 1}).")
    return list(spec)


def agree_layers(spec: LayerSpec, recorded: list[int], source: str,
                 where: str = "target.layers") -> list[int]:
    """The layers `source` (a cache, a drafter) was built with; an error only if the user set others."""
    wanted = explicit_layers(spec)
    if wanted is not None and wanted != list(recorded):
        raise DsparkError(f"{where} is {wanted}, but {source} was built with layers {list(recorded)}.",
                          hint=f"set target.layers = \"auto\" (or {list(recorded)}) to use {source}, "
                               "or rebuild it with those layers.")
    return list(recorded)
