"""OpenAI-compatible HTTP server and web view (`segfuse serve`; needs the `server` extra)."""

from .app import create_app, run

__all__ = ["create_app", "run"]
