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

    [ensembles.small]            # more models to serve, loaded when a request names them (docs/server.md)
    members = ["smollm2-135m", "gemma3-270m"]
    defaults = { gate = "none" } # over [defaults], for requests to this model
    # profile = "small.toml"     # or a profile's [fusion] table (`segfuse calibrate` writes one)
    # keep_alive = -1            # its members' keep-alive; -1 pins it (never freed by expiry or for room)
"""

from __future__ import annotations

import os
import re
import tomllib
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InvalidRequestError, SegfuseError
from .keep_alive import keep_alive_seconds
from .member_options import MAX_CONCURRENT, MemberOptions
from .options import FusionOptions

MAX_ENSEMBLE_MEMBERS = 7  # as Ensemble takes
DEFAULT_MEMBER_COUNT = 3  # an ensemble that names no members has the embedded three
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_count(value: int | str, where: str = "bytes") -> int:
    """A size as people write it: ``12GiB``, ``800MB``, ``1.5GB`` or a number of bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        number, unit = (float(match[1]), match[2].lower()) if match else (-1.0, "?")
    if number <= 0 or unit not in _UNITS:
        raise InvalidRequestError(f"{where}: {value!r} is not a size", 'write e.g. "12GiB", "800MB" or a byte count')
    return int(number * _UNITS[unit])


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
    keep_alive: str | float = Field(
        "5m",
        description="how long a member loaded on demand stays after its last answer: a duration, seconds, "
        "0 (free at once) or -1 (keep); a request's keep_alive goes over it",
    )
    preload: list[str] | None = Field(
        None, description="models loaded at start and kept until a request says otherwise (default: model_id)"
    )
    max_loaded_members: int | None = Field(
        None, ge=1, le=256, description="members loaded at once; past it the least recently used idle one goes"
    )
    max_loaded_bytes: int | str | None = Field(
        None,
        description='bytes the loaded members take at once: weights, and llama.cpp\'s KV cache and buffers ("12GiB", '
        '"800MB" or a number; a member not loaded yet counts its estimate); the same',
    )

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, value: str | float) -> str | float:
        try:
            keep_alive_seconds(value)
        except InvalidRequestError as exc:
            raise ValueError(f"{exc.message}; {exc.hint}") from None
        return value

    @field_validator("max_loaded_bytes")
    @classmethod
    def _bytes(cls, value: int | str | None) -> int | str | None:
        try:
            return value if value is None else byte_count(value)
        except InvalidRequestError as exc:
            raise ValueError(f"{exc.message}; {exc.hint}") from None

    def budget_bytes(self) -> int | None:
        return None if self.max_loaded_bytes is None else byte_count(self.max_loaded_bytes)

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


class EnsembleSection(BaseModel):
    """One more model the server serves: its members, loaded when a request names it, and its defaults."""

    model_config = ConfigDict(extra="forbid")

    members: list[str] = Field(min_length=1, max_length=MAX_ENSEMBLE_MEMBERS, description="member specs, in order")
    defaults: dict[str, Any] = Field(default_factory=dict, description="fusion options over [defaults]")
    profile: str | None = Field(None, description="a profile file whose [fusion] table goes under `defaults`")
    keep_alive: str | float | None = Field(
        None,
        description="how long its members stay after their last answer (over [server] keep_alive; a request's goes "
        "over it); -1 pins it: once loaded, never freed by expiry nor to make room for another model",
    )

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, value: str | float | None) -> str | float | None:
        return value if value is None else ServerSection._duration(value)


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
    ensembles: dict[str, EnsembleSection] = Field(default_factory=dict)

    def fusion_defaults(self) -> FusionOptions:
        """The [defaults] table as validated options (raises InvalidRequestError)."""
        return FusionOptions.build(**self.defaults)

    def ensemble_defaults(self, name: str) -> FusionOptions:
        """A declared ensemble's defaults: [defaults], its profile's [fusion] table, its own table."""
        from .profiles import load_profile

        section = self.ensembles[name]
        profile = load_profile(section.profile) if section.profile else {}
        return FusionOptions.build(**{**self.defaults, **profile, **section.defaults})

    def declared(self) -> dict[str, list[str]]:
        """Every model of ensembles the server serves, by name, with its member specs (empty: the
        embedded three). ``[server] model_id`` is one of them when [members] names models or when no
        [ensembles] are declared; the others are [ensembles]'."""
        models: dict[str, list[str]] = {}
        if self.members.models or not self.ensembles:
            models[self.server.model_id] = list(self.members.models)
        models.update({name: list(section.members) for name, section in self.ensembles.items()})
        return models

    def default_model(self) -> str:
        """What a request that names no model gets: model_id where it is served, else the first ensemble."""
        models = self.declared()
        return self.server.model_id if self.server.model_id in models else next(iter(models))

    def preloaded(self) -> list[str]:
        """The models loaded at start (and kept until a request says otherwise)."""
        return list(self.server.preload) if self.server.preload is not None else [self.default_model()]


def _describe(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"{where}: {err['msg']}")
    return f"invalid server configuration in {source}: " + "; ".join(lines)


def split_members(text: str) -> list[str]:
    """``SPEC,SPEC,...`` as `serve --ensemble` takes them: a piece with ``=`` after a spec with ``#``
    options goes on that spec's options (``transformers:x#device=cuda:0,dtype=bf16``)."""
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if specs and "#" in specs[-1] and "=" in piece and ":" not in piece.split("=")[0]:
            specs[-1] += "," + piece
        elif piece:
            specs.append(piece)
    return specs


def ensemble_flags(values: list[str]) -> dict[str, list[str]]:
    """``NAME=SPEC,SPEC,...`` flags -> name -> member specs."""
    declared: dict[str, list[str]] = {}
    for value in values:
        name, eq, members = value.partition("=")
        if not eq or not name.strip() or not split_members(members):
            raise ConfigError(
                f"--ensemble {value!r} is not NAME=SPEC,SPEC,...", "e.g. --ensemble small=smollm2-135m,gemma3-270m"
            )
        declared[name.strip()] = split_members(members)
    return declared


SECTIONS: dict[str, type[BaseModel]] = {
    "server": ServerSection,
    "members": MembersSection,
    "limits": LimitsSection,
    "ray": RaySection,
}


def build_config(
    path: str | os.PathLike[str] | None = None,
    *,
    defaults: dict[str, Any] | None = None,
    ensembles: dict[str, list[str]] | None = None,
    **overrides: Any,
) -> ServerConfig:
    """Read the TOML file (if any), apply non-None ``section.key`` overrides, validate.

    ``overrides`` use flat names: host, port, api_key, max_concurrent, queue_size, max_body_bytes,
    log_level, model_id, allowed_hosts, keep_alive, preload, max_loaded_* (server); models and any
    MemberOptions field (members); any [limits] field by its name (limits); any [ray] field (ray: enabled,
    address, replicas...). ``defaults`` are fusion options laid over the file's [defaults]; ``ensembles``
    (name -> member specs) are declared over the file's [ensembles]. The API key falls back to
    $SEGFUSE_API_KEY.
    """
    source = "flags" if path is None else str(path)
    data = _read_file(path) if path is not None else {}
    if defaults:
        table = data.setdefault("defaults", {})
        if isinstance(table, dict):  # else validation below reports the malformed section
            table.update(defaults)
    if ensembles:
        table = data.setdefault("ensembles", {})
        if isinstance(table, dict):
            for name, members in ensembles.items():
                table[name] = {**(table.get(name) or {}), "members": members}
    _apply_overrides(data, overrides)
    _api_key_from_environment(data)
    try:
        config = ServerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source), "see `segfuse serve --help` and docs/server.md") from None
    _check_defaults(config, source)
    _check_ensembles(config, source)
    return config


def _read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}", "check the --config path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}", "check its permissions") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}", "fix the syntax") from None


def _apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Each flat override into the section that has a field of its name."""
    for key, value in overrides.items():
        if value is None or (key == "models" and not value):
            continue
        section = next((name for name, cls in SECTIONS.items() if key in cls.model_fields), None)
        if section is None:
            raise ValueError(f"unknown override {key!r}")  # a programming error, not user input
        target = data.setdefault(section, {})
        if not isinstance(target, dict):
            break  # validation reports the malformed section
        target[key] = value


def _api_key_from_environment(data: dict[str, Any]) -> None:
    server = data.get("server")
    if isinstance(server, dict) and "api_key" not in server and os.environ.get("SEGFUSE_API_KEY"):
        server["api_key"] = os.environ["SEGFUSE_API_KEY"]
    elif server is None and os.environ.get("SEGFUSE_API_KEY"):
        data["server"] = {"api_key": os.environ["SEGFUSE_API_KEY"]}


def _check_defaults(config: ServerConfig, source: str) -> None:
    """[defaults] and every ensemble's valid, their max_tokens within [limits]."""
    tables = [("[defaults]", config.fusion_defaults)]
    tables += [(f"[ensembles.{name}]", partial(config.ensemble_defaults, name)) for name in config.ensembles]
    for where, build in tables:
        try:
            fusion = build()
        except SegfuseError as exc:
            raise ConfigError(f"{where} in {source}: {exc.message}", exc.hint or "see docs/server.md") from None
        if fusion.max_tokens > config.limits.max_tokens:
            raise ConfigError(
                f"{where} max_tokens {fusion.max_tokens} is above [limits] max_tokens "
                f"{config.limits.max_tokens} in {source}",
                "lower the default or raise the limit",
            )


def _check_ensembles(config: ServerConfig, source: str) -> None:
    """Several models: served by the local server, preloading ones it serves, without a shared Hedge state."""
    models = config.declared()
    unknown = [name for name in config.preloaded() if name not in models]
    if unknown:
        raise ConfigError(
            f"[server] preload names {unknown[0]!r}, which is not served, in {source}",
            f"name one of: {', '.join(models)}",
        )
    budget = config.server.max_loaded_members
    sizes = {name: len(specs) or DEFAULT_MEMBER_COUNT for name, specs in models.items()}
    largest = max(sizes, key=sizes.__getitem__)
    size = sizes[largest]
    if budget is not None and size > budget:
        raise ConfigError(
            f"model {largest!r} has {size} members and [server] max_loaded_members is {budget} in {source}",
            "raise max_loaded_members to the largest ensemble's size at least",
        )
    if len(models) < 2:
        return
    if config.server.hedge_persist:
        raise ConfigError(
            f"[server] hedge_persist with {len(models)} models in {source}: the weights carried over are one "
            "ensemble's",
            "serve one ensemble with hedge_persist, or turn it off",
        )
    if config.ray.enabled or config.ray.address is not None:
        raise ConfigError(
            f"{len(models)} models with --ray in {source}: a Ray server serves one ensemble",
            "serve the other ensembles with a server of their own, or without --ray",
        )
