"""Server configuration: a TOML file, command-line flags on top, validated by pydantic.

Plain data under the package root, so that whatever reads it (`segfuse serve`, the `llm` plugin, the
benchmarks) needs neither the server nor its extra.

Example ``segfuse.toml``::

    [server]
    host = "127.0.0.1"
    port = 8000
    api_key = "change-me"        # or set SEGFUSE_API_KEY; absent = no auth
    max_concurrent = 4           # generations in flight at once, batched together
    queue_size = 16              # requests waiting for a free slot; more get 429
    max_body_bytes = 1_000_000   # larger request bodies get 413
    allowed_hosts = ["segfuse.example.org"]   # Host headers served (default: the bound host and localhost)

    [limits]                     # what one request may cost (docs/server.md, Limits)
    max_tokens = 4096
    request_timeout_s = 600

    [members]                    # any member option (segfuse.member_options.MemberOptions)
    models = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]
    n_ctx = 4096
    prefix_cache_cells = 8192    # kept between requests (default: n_ctx x max_concurrent; 0: off)
    prefix_cache_dir = "auto"    # ...and across restarts, in this directory ("auto": the user's cache; default: none)
    gpu_layers = -1              # llama.cpp layers on the GPU (default: all where it can offload, else 0)

    [defaults]                   # fusion options for requests that do not set them
    max_tokens = 256
    temperature = 0.6
    window = 10
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import SegfuseError
from .member_options import MAX_CONCURRENT, MemberOptions
from .options import FusionOptions


class ConfigError(SegfuseError):
    """The server configuration file or flags are invalid."""


class ServerSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port")
    api_key: str | None = Field(None, min_length=1, description="required as 'Authorization: Bearer <key>'")
    model_id: str = Field("segfuse", min_length=1, description="the ensemble's name in /v1/models")
    max_concurrent: int = Field(
        4, ge=1, le=MAX_CONCURRENT, description="generations in flight at once (1: one after another)"
    )
    queue_size: int = Field(16, ge=0, le=10_000, description="requests waiting for a free slot")
    max_body_bytes: int = Field(1_000_000, ge=1024)
    log_level: str = Field("info", pattern="^(critical|error|warning|info|debug)$")
    hedge_persist: bool = Field(
        False,
        description="requests with Hedge on start from the weights the last one "
        "ended with (state shared by every client: the operator's choice, never a request's)",
    )
    stall_after_s: float = Field(
        120.0,
        gt=0,
        le=86_400,
        description="a worker step running longer is stalled: /health answers 503 with status stalled",
    )
    prefix_cache_save_minutes: float = Field(
        10.0,
        ge=0,
        le=10_080,
        description="with [members] prefix_cache_dir: write the members' cached prefixes there this often "
        "(0: only at shutdown)",
    )
    allowed_hosts: list[str] | None = Field(
        None,
        description="Host header values served, without the port ('*': any); default: the bound host, "
        "localhost, 127.0.0.1 and ::1 (bound to every interface with an API key: any)",
    )

    def hosts(self) -> frozenset[str] | None:
        """The Host names this server answers (lower case, no port); None: any.

        The check stops DNS rebinding, a web page reading a keyless server through a name of its own; a
        server on every interface that has a key answers any name by default (the key protects it)."""
        names = self.allowed_hosts
        if names is None:
            if self.host in WILDCARD_HOSTS and self.api_key is not None:
                return None
            names = [self.host, *LOCAL_HOSTS]
        if "*" in names:
            return None
        return frozenset(n.strip().lower().strip("[]") for n in names if n.strip())


LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class LimitsSection(BaseModel):
    """What one request may cost, and how long a connection may take. Each is refused with a 4xx naming the
    field and the limit (docs/server.md, Limits)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        description="the largest answer budget a request may ask "
        "for (max_tokens, max_completion_tokens, segfuse.max_tokens)",
    )
    max_stops: int = Field(16, ge=0, le=1024, description="stop strings per request (stop, segfuse.stop)")
    max_stop_chars: int = Field(256, ge=1, le=65_536, description="characters per stop string")
    max_prompts: int = Field(
        8, ge=1, le=1024, description="prompts per text completion (each takes a place in the queue)"
    )
    max_messages: int = Field(1024, ge=1, le=1_000_000, description="messages per chat request")
    max_content_chars: int = Field(
        400_000, ge=1, description="characters of all messages' contents (or all prompts) together"
    )
    max_tools: int = Field(128, ge=0, le=100_000, description="tools per request")
    max_tools_bytes: int = Field(262_144, ge=1, description="bytes of the tools' JSON together")
    max_schema_bytes: int = Field(
        65_536, ge=1, description="bytes of one JSON schema (response_format, a tool's parameters)"
    )
    max_schema_depth: int = Field(32, ge=1, le=1000, description="nesting of objects and arrays in one schema")
    max_json_depth: int = Field(64, ge=4, le=1000, description="nesting of objects and arrays in a request body")
    request_timeout_s: float = Field(
        600.0,
        ge=0,
        description="how long one request may take, queueing "
        "included; then its answer ends where it is (0: no deadline)",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="how long a client may take to send a request's line and headers"
    )
    body_timeout_s: float = Field(30.0, gt=0, description="how long a client may take to send a request body")
    limit_concurrency: int = Field(
        64,
        ge=1,
        description="requests in flight at once, from their headers to the "
        "end of their answer (a stream holds one throughout); more get 503",
    )
    max_pending_connections: int = Field(
        256,
        ge=1,
        description="connections waiting for a request (sending "
        "their headers, or idle between requests) that count, from all "
        "addresses; past it the oldest is closed",
    )
    max_pending_per_client: int = Field(
        16, ge=1, description="the same from one client address; past it that address's oldest is closed"
    )
    timeout_keep_alive_s: int = Field(5, ge=1, description="idle seconds before a kept-alive connection closes")
    max_header_bytes: int = Field(16_384, ge=1024, description="bytes of a request line and headers")

    @property
    def deadline_s(self) -> float | None:
        """The per-request deadline (None: none)."""
        return self.request_timeout_s or None


class MembersSection(MemberOptions):
    """The members and their load options (MemberOptions' fields: n_ctx, threads, gpu_layers, ...)."""

    models: list[str] = Field(default_factory=list, description="empty = the embedded default three")
    n_ctx: int = Field(4096, ge=256)

    def load_options(self) -> MemberOptions:
        """The options every member is loaded with."""
        return MemberOptions.build(self.model_dump(exclude={"models"}), where="[members]")


class RaySection(BaseModel):
    """`segfuse serve --ray`: the server as a Ray Serve application (docs/deploy.md, On a cluster)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        False, description="serve on Ray (--ray): front ends as Serve replicas, members as Ray actors"
    )
    address: str | None = Field(
        None,
        min_length=1,
        description="the cluster to join (HOST:PORT, auto); none: a local Ray instance this command starts and stops",
    )
    node_ip: str | None = Field(
        None,
        min_length=1,
        description="this machine's node address (default: "
        "127.0.0.2 for a local instance; never 127.0.0.1 or localhost)",
    )
    replicas: int = Field(1, ge=1, le=256, description="front-end replicas behind Serve's proxy")
    frontend_cpus: float = Field(0.5, ge=0, description="CPUs each front-end replica asks Ray for")
    local_cpus: int | None = Field(
        None,
        ge=1,
        description="CPUs the local instance declares (default: the machine's, or what the members ask if more)",
    )
    app_name: str = Field(
        "segfuse", min_length=1, pattern=r"^[A-Za-z0-9_-]+$", description="the Serve application's name"
    )
    proxy_location: Literal["HeadOnly", "EveryNode"] = Field(
        "HeadOnly", description="where Serve runs its HTTP proxies"
    )
    proxy_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Serve's http_options.request_timeout_s: the proxy ends a request after this long (default: never)",
    )


class ServerConfig(BaseModel):
    """Everything `segfuse serve` needs. ``defaults`` are FusionOptions fields."""

    model_config = ConfigDict(extra="forbid")

    server: ServerSection = Field(default_factory=ServerSection)
    members: MembersSection = Field(default_factory=MembersSection)
    limits: LimitsSection = Field(default_factory=LimitsSection)
    ray: RaySection = Field(default_factory=RaySection)
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


def build_config(
    path: str | os.PathLike[str] | None = None, *, defaults: dict[str, Any] | None = None, **overrides: Any
) -> ServerConfig:
    """Read the TOML file (if any), apply non-None ``section.key`` overrides, validate.

    ``overrides`` use flat names: host, port, api_key, max_concurrent, queue_size, max_body_bytes,
    log_level, model_id, allowed_hosts (server); models and any MemberOptions field (members);
    any [limits] field by its name (limits); any [ray] field (ray: enabled, address, replicas...). ``defaults`` are
    fusion options laid over the file's [defaults]. The API key falls back to $SEGFUSE_API_KEY.
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
    sections: dict[str, type[BaseModel]] = {
        "server": ServerSection,
        "members": MembersSection,
        "limits": LimitsSection,
        "ray": RaySection,
    }
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
    if isinstance(server, dict) and "api_key" not in server and os.environ.get("SEGFUSE_API_KEY"):
        server["api_key"] = os.environ["SEGFUSE_API_KEY"]
    elif server is None and os.environ.get("SEGFUSE_API_KEY"):
        data["server"] = {"api_key": os.environ["SEGFUSE_API_KEY"]}
    try:
        config = ServerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source), "see `segfuse serve --help` and docs/server.md") from None
    try:
        fusion = config.fusion_defaults()
    except SegfuseError as exc:
        raise ConfigError(f"[defaults] in {source}: {exc.message}", "see docs/server.md") from None
    if fusion.max_tokens > config.limits.max_tokens:
        raise ConfigError(
            f"[defaults] max_tokens {fusion.max_tokens} is above [limits] max_tokens "
            f"{config.limits.max_tokens} in {source}",
            "lower the default or raise the limit",
        )
    return config
