"""The `segfuse` command line: generate, chat, demo, serve, models, eval, bench."""

from . import commands  # noqa: F401  # registers every command on `app`
from .app import app, main

__all__ = ["app", "main"]
