"""What `--help` shows a person: metavars they read (PATH, URL, KEY=VALUE, N) instead of typer's
`<str>` and `<list[str]>`, and `dspark --help` listing its commands in pipeline order.

Applied once to the click command tree typer builds, so no command spells a metavar by hand.
"""

from __future__ import annotations

from typing import Any

#: `dspark --help` order: convert the target, then the stages as a pipeline runs them, then the tools.
ORDER = ("model", "data", "cache", "plan", "train", "calibrate", "eval", "export", "profile", "serve",
         "pipeline")

#: Metavar by option or argument name (without dashes, underscores as dashes).
_BY_NAME = {
    "set": "KEY=VALUE", "endpoint": "URL", "device": "DEVICE", "dtype": "DTYPE", "target-dtype": "DTYPE",
    "storage-dtype": "DTYPE", "model": "NAME", "served-model-name": "NAME", "host": "HOST",
    "schedule": "NAME", "architecture": "NAME", "compression": "NAME", "api-key-env": "VAR",
    "layers": "N,N,…", "batch-tokens": "N,N,…", "concurrency-sweep": "N,N,…", "source": "PATH|ID",
    "target": "PATH|ID", "dataset": "PATH", "stages": "STAGE,…", "split": "NAME",
}


def readable_help(command: Any) -> None:
    """Set human metavars on every parameter of `command` and its subcommands, and order groups."""
    commands = getattr(command, "commands", None)
    if commands is not None:
        ordered = sorted(commands, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))
        command.commands = {name: commands[name] for name in ordered}
        for sub in command.commands.values():
            readable_help(sub)
    for param in getattr(command, "params", []):
        if param.metavar is None and not getattr(param, "is_flag", False):
            param.metavar = _metavar(param)
        if param.param_type_name == "argument" and hasattr(param, "display_type_rich"):
            param.display_type_rich = _no_type  # typer lists arguments as `MODEL <str>`: the name says it


def _no_type(ctx: Any) -> None:
    return None


def _metavar(param: Any) -> str | None:
    name = (param.name or "").replace("_", "-").rstrip("-")
    if param.param_type_name == "argument":
        return "OUT" if name == "out-dir" else name.upper().replace("-", "_")
    kind = _kind(param)
    if name in _BY_NAME and (kind == "str" or not _BY_NAME[name].startswith("N,")):
        return _BY_NAME[name]
    if kind == "int":
        return "N"
    if kind == "float":
        return "X"
    if kind == "str":
        return "PATH"  # the remaining text options name files, folders or URLs (config, -i, -o, …)
    return None


def _kind(param: Any) -> str:
    """'int', 'float', 'str' (of a list too), or '' for anything else (choices, flags)."""
    if hasattr(param, "bare_type"):  # typer >= 0.25's own click: a type descriptor, no click type
        kind = param.bare_type()
        return kind.removeprefix("list[").removesuffix("]")
    return {"integer": "int", "float": "float", "text": "str"}.get(getattr(param.type, "name", ""), "")
