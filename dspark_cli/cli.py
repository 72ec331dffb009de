"""The `dspark` program: wires one command group per stage; the commands live in `commands/`.

User mistakes (DsparkError), and what the OS or a file format raises (`environment_error`), print
one line and a hint and exit 2; set DSPARK_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import functools
import os
import sys

import typer

from . import __version__
from .errors import DsparkError, environment_error
from .redact import redact

app = typer.Typer(
    name="dspark",
    help="Train DSpark speculative-decoding drafters end to end.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's plain help, in every group: typer's rich tables give a mostly empty `--no-X` and
    # metavar column the width, cutting descriptions to ~21 characters at 80 columns.
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dspark {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Stages: data prepare → data regen → cache build → train → calibrate → eval."""


@functools.cache
def command() -> typer.core.TyperGroup:
    """The click command tree of `app`, with the help a person reads (`commands/_help.py`).

    Built once per process: each build registered every command into `app` again, so a process
    calling `main` many times (the test suite) grew the tree and its build time with every call:
    2.3 s a `--help` after a few hundred calls."""
    from .commands import register_all
    from .commands._help import readable_help

    register_all(app)
    tree = typer.main.get_command(app)
    readable_help(tree)
    return tree


def main(argv: list[str] | None = None) -> None:
    tree = command()
    try:
        code = tree.main(args=argv, standalone_mode=False, prog_name="dspark")
        if code == 130:  # typer turns Ctrl-C into a returned 130 (no dspark command exits 130 itself)
            _interrupted()
        if isinstance(code, int) and code:  # a command's typer.Exit(n): click returns n here
            sys.exit(code)
    except DsparkError as e:
        exit_with_error(e)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("aborted.", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        _interrupted()
    except _click_exceptions() as e:  # usage errors: click's one-line message + usage, exit 2
        e.show()
        sys.exit(e.exit_code)
    except Exception as e:  # the environment's faults (OSError, damaged files): one line too
        mapped = environment_error(e)
        if mapped is None:
            raise
        exit_with_error(mapped, e)


def _interrupted() -> None:
    """Ctrl-C (SIGINT), for every stage: what was committed stays, so the same command resumes."""
    print("\ninterrupted; rerun the same command to resume.", file=sys.stderr)
    sys.exit(130)


def exit_with_error(e: DsparkError, cause: BaseException | None = None) -> None:
    """Print the one `error:` line (+ hint), secrets removed, and exit; DSPARK_DEBUG=1 re-raises."""
    if os.environ.get("DSPARK_DEBUG"):
        raise cause or e
    print(f"error: {redact(str(e))}", file=sys.stderr)
    if e.hint:
        print(f"hint: {redact(e.hint)}", file=sys.stderr)
    sys.exit(e.exit_code)


def _click_exceptions() -> tuple[type[Exception], ...]:
    """Click's exception base and, for typer >= 0.25 (which bundles its own copy), typer's.

    The two are unrelated classes, so catching only `click.ClickException` let every usage error
    of a newer typer escape as a traceback.
    """
    import click

    found: list[type[Exception]] = [click.exceptions.ClickException]
    try:
        from typer._click.exceptions import ClickException as TyperClickException
    except ImportError:
        pass
    else:
        found.append(TyperClickException)
    return tuple(found)


if __name__ == "__main__":
    main()
