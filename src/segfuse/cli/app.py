"""The typer application, its group of commands (each listed in one line of --help), its consoles, and the entry
point that turns user errors into one line."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from .. import __version__
from ..errors import SegfuseError


class Group(TyperGroup):
    """A group of commands whose --help lists each command by the first paragraph of its docstring as one line
    of text, wrapped to the terminal: typer keeps the docstring's hard line breaks there, mid-sentence."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for command in self.commands.values():
            if command.short_help is None and command.help:
                command.short_help = " ".join(inspect.cleandoc(command.help).split("\n\n")[0].split())


app = typer.Typer(
    cls=Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Fuse several LLMs at inference time, one verified segment at a time (the SpecFuse method).",
)
models_app = typer.Typer(
    cls=Group,
    help="List the models you can name (embedded and your own) and prepare the embedded ones.",
    invoke_without_command=True,
)
app.add_typer(models_app, name="models")

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def _print_version(asked: bool) -> None:
    if asked:
        out.print(f"segfuse {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", callback=_print_version, is_eager=True
    ),
) -> None:
    """Fuse several LLMs at inference time, one verified segment at a time (the SpecFuse method)."""


def main() -> None:
    """Console entry point: user errors become one line and exit status 2."""
    try:
        app()
    except SegfuseError as exc:
        text = exc.message + (f" — {exc.hint}" if exc.hint else "")
        err.print(f"[bold red]error:[/] {escape(text)}", soft_wrap=True)  # "[server]" is text, not markup
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
