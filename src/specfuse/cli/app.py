"""The typer application, its consoles, and the entry point that turns user errors into one line."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import SpecFuseError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Fuse several LLMs at inference time, one verified segment at a time.",
)
models_app = typer.Typer(help="List the models you can name (embedded and your own) and prepare the embedded ones.",
                         invoke_without_command=True)
app.add_typer(models_app, name="models")

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def main() -> None:
    """Console entry point: user errors become one line and exit status 2."""
    try:
        app()
    except SpecFuseError as exc:
        text = exc.message + (f" — {exc.hint}" if exc.hint else "")
        err.print(f"[bold red]error:[/] {escape(text)}", soft_wrap=True)  # "[server]" is text, not markup
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
