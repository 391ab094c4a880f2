"""The `segfuse` command line: generate, chat, demo, serve, models, eval, bench."""

from .app import app, main
from . import commands  # noqa: E402,F401  (registers every command on `app`)

__all__ = ["app", "main"]
