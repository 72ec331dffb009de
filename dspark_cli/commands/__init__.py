"""One module per command group; each command is thin: check flags, call the library, render."""

from __future__ import annotations

import importlib

import typer

#: Command modules, in the order `dspark --help` lists them. Each exposes `register(app)`.
GROUPS = ("data", "cache", "train", "export", "calibrate", "eval", "profile", "serve", "model", "pipeline",
          "plan")


def register_all(app: typer.Typer) -> None:
    for name in GROUPS:
        importlib.import_module(f"{__name__}.{name}").register(app)
