"""`segfuse serve`: the OpenAI-compatible server and its web view."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..extras import require
from .app import app
from .flags import ModelOpt, fusion_flags


@app.command()
@fusion_flags(members=True)
def serve(
    config: Annotated[str | None, typer.Option("--config", "-c", help="TOML config file (see docs/server.md).")] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000).")] = None,
    model: ModelOpt = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", help="Require 'Authorization: Bearer KEY' (default: $SEGFUSE_API_KEY, else no auth)."
        ),
    ] = None,
    max_concurrent: Annotated[
        int | None,
        typer.Option(
            "--max-concurrent",
            help="Generations in flight at once, their member work batched (default 4; 1 runs one after another).",
        ),
    ] = None,
    queue_size: Annotated[
        int | None, typer.Option("--queue-size", help="Requests that may wait for a free slot (default 16).")
    ] = None,
    allowed_hosts: Annotated[
        str | None,
        typer.Option(
            "--allowed-hosts",
            help="Host header names served, comma-separated ('*': any); others get 400 "
            "(default: the bound host, localhost, 127.0.0.1, ::1). Name the proxy's public name here.",
        ),
    ] = None,
    max_tokens_limit: Annotated[
        int | None,
        typer.Option(
            "--max-tokens-limit",
            min=1,
            help="The largest max_tokens a request may ask for; more gets 400 (default 4096; [limits] max_tokens).",
        ),
    ] = None,
    request_timeout: Annotated[
        float | None,
        typer.Option(
            "--request-timeout",
            min=0,
            help="Seconds one request may take, queueing included; then its answer "
            "ends where it is (default 600; 0: no deadline).",
        ),
    ] = None,
    limit_concurrency: Annotated[
        int | None,
        typer.Option(
            "--limit-concurrency",
            min=1,
            help="Requests in flight at once, from their headers to the end "
            "of their answer; more get 503 (default 64). Connections without a request do not count.",
        ),
    ] = None,
    prefix_cache_save_minutes: Annotated[
        float | None,
        typer.Option(
            "--prefix-cache-save-minutes",
            min=0,
            help="With --prefix-cache-dir: write the cached prefixes there this often, and at shutdown "
            "(default 10; 0: only at shutdown).",
        ),
    ] = None,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Serve on Ray: the front end as Ray Serve replicas behind Serve's proxy (on --host/--port), "
            "each member's copies as Ray actors (-m SPEC#replicas=K). A local Ray instance unless --ray-address "
            "(\\[ray] in the config; docs/deploy.md).",
        ),
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address",
            help="With --ray (implied): the Ray cluster to join (HOST:PORT, auto) instead of a local instance.",
        ),
    ] = None,
    replicas: Annotated[
        int | None, typer.Option("--replicas", min=1, help="With --ray: front-end replicas (default 1).")
    ] = None,
    fusion: dict[str, Any] | None = None,
    member_options: dict[str, Any] | None = None,
) -> None:
    """Serve the ensemble over an OpenAI-compatible API, with a web view at /.

    Fusion options given here are the defaults of requests that do not set them
    (over the config file's \\[defaults] table); member options go over its \\[members] table.
    """
    require("server", "segfuse serve")
    from ..config import build_config
    from ..server import run  # FastAPI and uvicorn load only for this command

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
        defaults=fusion or None,
        enabled=ray or ray_address is not None or None,
        address=ray_address,
        replicas=replicas,
        **(member_options or {}),
    )
    if settings.ray.enabled or settings.ray.address is not None:
        require("ray", "segfuse serve --ray")
        from ..server.ray.run import run_on_ray

        run_on_ray(settings)
    else:
        run(settings)
