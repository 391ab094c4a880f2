"""Server configuration: a TOML file, command-line flags on top, validated by pydantic.

Example ``specfuse.toml``::

    [server]
    host = "127.0.0.1"
    port = 8000
    api_key = "change-me"        # or set SPECFUSE_API_KEY; absent = no auth
    max_concurrent = 4           # generations in flight at once, batched together
    queue_size = 16              # requests waiting for a free slot; more get 429
    max_body_bytes = 1_000_000   # larger request bodies get 413

    [members]
    models = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]
    n_ctx = 4096
    prefix_cache_cells = 8192    # kept between requests (default: n_ctx x max_concurrent; 0: off)

    [defaults]                   # fusion options for requests that do not set them
    max_tokens = 256
    temperature = 0.6
    window = 10
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..ensemble import MAX_CONCURRENT
from ..errors import SpecFuseError
from ..options import FusionOptions


class ConfigError(SpecFuseError):
    """The server configuration file or flags are invalid."""


class ServerSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port")
    api_key: str | None = Field(None, min_length=1, description="required as 'Authorization: Bearer <key>'")
    model_id: str = Field("specfuse", min_length=1, description="the ensemble's name in /v1/models")
    max_concurrent: int = Field(4, ge=1, le=MAX_CONCURRENT,
                                description="generations in flight at once (1: one after another)")
    queue_size: int = Field(16, ge=0, le=10_000, description="requests waiting for a free slot")
    max_body_bytes: int = Field(1_000_000, ge=1024)
    log_level: str = Field("info", pattern="^(critical|error|warning|info|debug)$")


class MembersSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[str] = Field(default_factory=list, description="empty = the embedded default three")
    n_ctx: int = Field(4096, ge=256)
    prefix_cache_cells: int | None = Field(
        None, ge=0, description="KV-cache cells a llama.cpp member keeps between requests (chats' earlier "
        "turns, shared system prompts); default n_ctx x max_concurrent; 0 = off")
    threads: int | None = Field(None, ge=1)
    cache_dir: str | None = None


class ServerConfig(BaseModel):
    """Everything `specfuse serve` needs. ``defaults`` are FusionOptions fields."""

    model_config = ConfigDict(extra="forbid")

    server: ServerSection = Field(default_factory=ServerSection)
    members: MembersSection = Field(default_factory=MembersSection)
    defaults: dict[str, Any] = Field(default_factory=dict)

    def fusion_defaults(self) -> FusionOptions:
        """The [defaults] table as validated options (raises InvalidRequestError)."""
        return FusionOptions.build(**self.defaults)


def _describe(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"{where}: {err['msg']}")
    return f"invalid server configuration in {source}: " + "; ".join(lines)


def build_config(path: str | os.PathLike[str] | None = None, *, defaults: dict[str, Any] | None = None,
                 **overrides: Any) -> ServerConfig:
    """Read the TOML file (if any), apply non-None ``section.key`` overrides, validate.

    ``overrides`` use flat names: host, port, api_key, max_concurrent, queue_size, max_body_bytes,
    log_level, model_id (server); models, n_ctx, threads, cache_dir, prefix_cache_cells (members). ``defaults`` are
    fusion options laid over the file's [defaults]. The API key falls back to $SPECFUSE_API_KEY.
    """
    data: dict[str, Any] = {}
    source = "flags"
    if path is not None:
        source = str(path)
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}", "check the --config path") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}", "check its permissions") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}", "fix the syntax") from None
    if defaults:
        table = data.setdefault("defaults", {})
        if isinstance(table, dict):  # else validation below reports the malformed section
            table.update(defaults)
    sections = {"server": ServerSection, "members": MembersSection}
    for key, value in overrides.items():
        if value is None or (key == "models" and not value):
            continue
        section = next((name for name, cls in sections.items() if key in cls.model_fields), None)
        if section is None:
            raise ValueError(f"unknown override {key!r}")  # a programming error, not user input
        target = data.setdefault(section, {})
        if not isinstance(target, dict):
            break  # validation below reports the malformed section
        target[key] = value
    server = data.get("server")
    if isinstance(server, dict) and "api_key" not in server and os.environ.get("SPECFUSE_API_KEY"):
        server["api_key"] = os.environ["SPECFUSE_API_KEY"]
    elif server is None and os.environ.get("SPECFUSE_API_KEY"):
        data["server"] = {"api_key": os.environ["SPECFUSE_API_KEY"]}
    try:
        config = ServerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source), "see `specfuse serve --help` and docs/server.md") from None
    try:
        config.fusion_defaults()
    except SpecFuseError as exc:
        raise ConfigError(f"[defaults] in {source}: {exc.message}", "see docs/server.md") from None
    return config
