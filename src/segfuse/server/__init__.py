"""OpenAI-compatible HTTP server and web view (`segfuse serve`; needs the `server` extra)."""

from .app import create_app, run
from .config import ConfigError, ServerConfig, build_config

__all__ = ["ConfigError", "ServerConfig", "build_config", "create_app", "run"]
