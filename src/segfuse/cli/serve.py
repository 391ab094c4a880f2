"""`segfuse serve`: the OpenAI-compatible server and its web view."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..extras import require
from .app import app
from .flags import ModelOpt, fusion_flags

if TYPE_CHECKING:
    from ..config import ServerConfig

Config = Annotated[str | None, typer.Option("--config", "-c", help="TOML config file (see docs/server.md).")]
Host = Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")]
Port = Annotated[int | None, typer.Option(help="Port (default 8000).")]
ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", help="Require 'Authorization: Bearer KEY' (default: $SEGFUSE_API_KEY, else no auth)."),
]
MaxConcurrent = Annotated[
    int | None,
    typer.Option(
        "--max-concurrent",
        help="Generations in flight at once, their member work batched (default 4; 1 runs one after another).",
    ),
]
QueueSize = Annotated[
    int | None, typer.Option("--queue-size", help="Requests that may wait for a free slot (default 16).")
]
AllowedHosts = Annotated[
    str | None,
    typer.Option(
        "--allowed-hosts",
        help="Host header names served, comma-separated ('*': any); others get 400 "
        "(default: the bound host, localhost, 127.0.0.1, ::1). Name the proxy's public name here.",
    ),
]
MaxTokensLimit = Annotated[
    int | None,
    typer.Option(
        "--max-tokens-limit",
        min=1,
        help="The largest max_tokens a request may ask for; more gets 400 (default 4096; [limits] max_tokens).",
    ),
]
RequestTimeout = Annotated[
    float | None,
    typer.Option(
        "--request-timeout",
        min=0,
        help="Seconds one request may take, queueing included; then its answer "
        "ends where it is (default 600; 0: no deadline).",
    ),
]
LimitConcurrency = Annotated[
    int | None,
    typer.Option(
        "--limit-concurrency",
        min=1,
        help="Requests in flight at once, from their headers to the end "
        "of their answer; more get 503 (default 64). Connections without a request do not count.",
    ),
]
PrefixCacheSaveMinutes = Annotated[
    float | None,
    typer.Option(
        "--prefix-cache-save-minutes",
        min=0,
        help="With --prefix-cache-dir: write the cached prefixes there this often, and at shutdown "
        "(default 10; 0: only at shutdown).",
    ),
]
EnsembleOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--ensemble",
        "-e",
        help="Serve one more model: NAME=SPEC,SPEC,... (repeat). Its members load when a request names it "
        "and are freed when idle; a member two ensembles name is loaded once (docs/server.md, Several models).",
    ),
]
KeepAlive = Annotated[
    str | None,
    typer.Option(
        "--keep-alive",
        help="How long a member loaded on demand stays after its last answer: 5m, 1h, 90s, 0 (free at once), "
        "-1 (keep) (default 5m; a request's keep_alive goes over it).",
    ),
]
MaxLoadedMembers = Annotated[
    int | None,
    typer.Option(
        "--max-loaded-members", min=1, help="Members loaded at once; past it the least recently used idle one goes."
    ),
]
MaxLoadedBytes = Annotated[
    str | None,
    typer.Option(
        "--max-loaded-bytes",
        help="Bytes the loaded members take at once (12GiB, 800MB): weights, KV caches; the same. A model that can "
        "never fit is refused.",
    ),
]
Ray = Annotated[
    bool,
    typer.Option(
        "--ray",
        help="Serve on Ray: the front end as Ray Serve replicas behind Serve's proxy (on --host/--port), "
        "each member's copies as Ray actors (-m SPEC#replicas=K). A local Ray instance unless --ray-address "
        "(\\[ray] in the config; docs/deploy.md).",
    ),
]
RayAddress = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        help="With --ray (implied): the Ray cluster to join (HOST:PORT, auto) instead of a local instance.",
    ),
]
Replicas = Annotated[int | None, typer.Option("--replicas", min=1, help="With --ray: front-end replicas (default 1).")]


@app.command()
@fusion_flags(members=True)
def serve(
    config: Config = None,
    host: Host = None,
    port: Port = None,
    model: ModelOpt = None,
    ensemble: EnsembleOpt = None,
    api_key: ApiKey = None,
    max_concurrent: MaxConcurrent = None,
    queue_size: QueueSize = None,
    allowed_hosts: AllowedHosts = None,
    max_tokens_limit: MaxTokensLimit = None,
    request_timeout: RequestTimeout = None,
    limit_concurrency: LimitConcurrency = None,
    prefix_cache_save_minutes: PrefixCacheSaveMinutes = None,
    keep_alive: KeepAlive = None,
    max_loaded_members: MaxLoadedMembers = None,
    max_loaded_bytes: MaxLoadedBytes = None,
    ray: Ray = False,
    ray_address: RayAddress = None,
    replicas: Replicas = None,
    fusion: dict[str, Any] | None = None,
    member_options: dict[str, Any] | None = None,
) -> None:
    """Serve the ensemble over an OpenAI-compatible API, with a web view at /.

    Fusion options given here are the defaults of requests that do not set them
    (over the config file's \\[defaults] table); member options go over its \\[members] table.
    """
    require("server", "segfuse serve")
    from ..config import build_config, ensemble_flags

    hosts = [h.strip() for h in allowed_hosts.split(",") if h.strip()] if allowed_hosts is not None else None
    settings = build_config(
        config,
        host=host,
        port=port,
        models=model,
        api_key=api_key,
        queue_size=queue_size,
        max_concurrent=max_concurrent,
        allowed_hosts=hosts,
        max_tokens=max_tokens_limit,
        request_timeout_s=request_timeout,
        limit_concurrency=limit_concurrency,
        prefix_cache_save_minutes=prefix_cache_save_minutes,
        keep_alive=keep_alive,
        max_loaded_members=max_loaded_members,
        max_loaded_bytes=max_loaded_bytes,
        defaults=fusion or None,
        ensembles=ensemble_flags(ensemble) if ensemble else None,
        enabled=ray or ray_address is not None or None,
        address=ray_address,
        replicas=replicas,
        **(member_options or {}),
    )
    _run(settings)


def _run(settings: ServerConfig) -> None:
    """Serve here, or on Ray."""
    if settings.ray.enabled or settings.ray.address is not None:
        require("ray", "segfuse serve --ray")
        from ..server.ray.run import run_on_ray

        run_on_ray(settings)
    else:
        from ..server import run  # FastAPI and uvicorn load only for this command

        run(settings)
