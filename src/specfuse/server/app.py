"""The FastAPI application: thin routes over ``serving`` and the worker.

``create_app`` is what tests and embedders use; ``run`` is `specfuse serve`.
Members are loaded before the app starts (``run``) or, when the app is created
without an ensemble, in a background thread while /health says "loading" and
completions answer 503. /health and /metrics (Prometheus) need no API key.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..ensemble import Ensemble
from ..errors import SpecFuseError
from ..options import FusionOptions
from . import completions, parsing, serving
from .config import ServerConfig
from .metrics import ServerMetrics
from .protocol import Health, MemberOccupancy, ModelCard, ModelList, QueueState
from .serving import APIError
from .worker import Job, Worker

log = logging.getLogger("specfuse.server")
STATIC = Path(__file__).with_name("static")
DRAIN_FACTOR = 16  # read (and drop) up to this many times the body limit, so the 413 reaches the client


@dataclass
class ServerState:
    """What the routes share: the config, the worker and whether members are ready."""

    config: ServerConfig
    defaults: FusionOptions
    worker: Worker
    metrics: ServerMetrics
    status: Literal["ok", "loading", "failed"] = "loading"
    error: str | None = None
    members: list[str] = field(default_factory=list)
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_id(self) -> str:
        return self.config.server.model_id


def load_ensemble(config: ServerConfig) -> Ensemble:
    """Load the configured members (the embedded three when none are named)."""
    m = config.members
    cache = {} if m.prefix_cache_cells is None else {"prefix_cache_cells": m.prefix_cache_cells}
    return Ensemble(m.models or None, cache_dir=m.cache_dir, threads=m.threads, n_ctx=m.n_ctx,
                    slots=config.server.max_concurrent, **cache)


def create_app(config: ServerConfig, ensemble: Ensemble | None = None) -> FastAPI:
    """The ASGI app. With ``ensemble`` given the caller keeps ownership of it."""
    worker = Worker(config.server.queue_size, config.server.max_concurrent)
    state = ServerState(config, config.fusion_defaults(), worker, ServerMetrics(worker))
    worker.observer = state.metrics
    owned: list[Ensemble] = []

    def attach(ens: Ensemble) -> None:
        if not ens.members:
            state.status, state.error = "failed", "the ensemble has no members"
            return
        state.worker.start(ens)
        state.metrics.members(ens.names)
        state.members, state.status = ens.names, "ok"
        log.info("serving %s with members %s", state.model_id, ", ".join(ens.names))

    def load_in_background() -> None:
        try:
            ens = load_ensemble(config)
        except SpecFuseError as exc:
            state.status, state.error = "failed", str(exc)
            log.error("could not load the members: %s", exc)
            return
        except Exception as exc:  # report, keep the server up so /health can say why
            state.status, state.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("could not load the members")
            return
        owned.append(ens)
        attach(ens)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if ensemble is not None:
            attach(ensemble)
        else:
            threading.Thread(target=load_in_background, name="specfuse-loader", daemon=True).start()
        yield
        await asyncio.to_thread(state.worker.stop)
        for ens in owned:
            ens.close()

    # No /docs or /redoc: their pages load scripts from a CDN, and the server must work offline.
    app = FastAPI(title="SpecFuse", summary="OpenAI-compatible API of a SpecFuse ensemble",
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.specfuse = state
    _add_error_handlers(app)
    _add_routes(app, state)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


# --------------------------------------------------------------------------- errors


def _error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        return _error_response(APIError(422, f"{where}: {first['msg']}", code="invalid_value"))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(serving.api_error(exc))


# --------------------------------------------------------------------------- routes


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 once it passes ``limit`` bytes (drained a while so the client sees the 413)."""
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_big = True
        if too_big:
            if size > DRAIN_FACTOR * limit:
                break
            continue
        parts.append(chunk)
    if too_big:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    return b"".join(parts)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    require_key = Depends(_key_check(state))
    _add_status_routes(app, state)
    _add_model_routes(app, state, require_key)
    _add_completion_route(app, state, require_key)
    _add_text_completion_route(app, state, require_key)


def _key_check(state: ServerState) -> Callable[[Request], Awaitable[None]]:
    """The dependency that enforces the API key (none configured: every request passes)."""

    async def require_key(request: Request) -> None:
        key = state.config.server.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    return require_key


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """The web view, /health and /metrics: open, no request content."""
    worker = state.worker

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/health", response_model=Health)
    async def health() -> JSONResponse:
        waiting, running = worker.state()
        body = Health(status=state.status, model=state.model_id, members=state.members, error=state.error,
                      queue=QueueState(waiting=waiting, running=running, capacity=worker.queue_size,
                                       max_concurrent=worker.max_concurrent),
                      counters=worker.snapshot(),
                      occupancy={name: MemberOccupancy(**asdict(held)) for name, held in worker.occupancy().items()})
        return JSONResponse(body.model_dump(), status_code=200 if state.status == "ok" else 503)

    # Open like /health, for scrapers: counts and timings only, no request content.
    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)


def _model_cards(state: ServerState) -> list[ModelCard]:
    """The fused model, then each member (a member alone is a model of its own: a baseline)."""
    cards = [ModelCard(id=state.model_id, created=state.started, members=state.members)]
    cards += [ModelCard(id=name, created=state.started, parent=state.model_id) for name in state.members]
    return cards


def _add_model_routes(app: FastAPI, state: ServerState, require_key: Any) -> None:
    @app.get("/v1/models", response_model=ModelList, dependencies=[require_key])
    async def list_models() -> ModelList:
        return ModelList(data=_model_cards(state))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=[require_key])
    async def get_model(model_id: str) -> ModelCard:
        for card in _model_cards(state):
            if card.id == model_id:
                return card
        raise APIError(404, f"unknown model {model_id!r}", code="model_not_found", param="model")


def _require_members(state: ServerState) -> None:
    if state.status == "loading":
        raise APIError(503, "the members are still loading; retry shortly", "server_error", "loading")
    if state.status == "failed":
        raise APIError(503, f"no members available: {state.error}", "server_error", "no_members")


def _members_for(state: ServerState, model: str) -> list[str] | None:
    """Who answers a request for `model`: every member (None) for the fused model, or one member alone."""
    if model == state.model_id:
        return None
    if model in state.members:
        return [model]
    raise APIError(404, f"unknown model {model!r}; this server serves {state.model_id!r} "
                   f"and its members {', '.join(state.members)}", code="model_not_found", param="model")


def _add_completion_route(app: FastAPI, state: ServerState, require_key: Any) -> None:
    worker = state.worker

    # The body is parsed by hand (serving.parse_request) to tell bad JSON (400) from a bad shape (422).
    @app.post("/v1/chat/completions", dependencies=[require_key])
    async def chat_completions(request: Request) -> Response:
        body = await _read_body(request, state.config.server.max_body_bytes)
        parsed = parsing.parse_request(body)
        _require_members(state)
        model = parsed.model or state.model_id
        members = _members_for(state, model)
        tools, mode = parsing.offered_tools(parsed)
        top = parsing.top_logprobs(parsed)
        job = Job(parsing.to_engine_messages(parsed, tools, mode), parsing.fusion_options(parsed, state.defaults),
                  members, parsing.constraint_of(parsed, tools, mode), tools if mode != "none" else [],
                  logprobs=top is not None, top_logprobs=top or 0)
        if parsed.user:
            log.info("%s for user %s", job.id, parsed.user)
        job.bind(asyncio.get_running_loop())
        try:
            worker.submit(job)
        except SpecFuseError as exc:
            raise serving.api_error(exc) from None

        def cancel() -> None:
            worker.cancel(job)

        if parsed.stream:
            return StreamingResponse(
                serving.stream(job, model, parsed.include_usage, cancel),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                background=BackgroundTask(cancel),  # also runs when the client hung up
            )

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        result = await serving.complete(job, model, disconnected, cancel)
        return JSONResponse(result.model_dump(mode="json"))


def _add_text_completion_route(app: FastAPI, state: ServerState, require_key: Any) -> None:
    worker = state.worker

    @app.post("/v1/completions", dependencies=[require_key])
    async def text_completions(request: Request) -> Response:
        body = await _read_body(request, state.config.server.max_body_bytes)
        parsed = parsing.parse_request(body, completions.COMPLETIONS)
        _require_members(state)
        model = parsed.model or state.model_id
        jobs = completions.jobs_of(parsed, state.defaults, _members_for(state, model))
        loop = asyncio.get_running_loop()
        try:
            for job in jobs:
                job.bind(loop)
                worker.submit(job)
        except SpecFuseError as exc:
            for job in jobs:
                worker.cancel(job)
            raise serving.api_error(exc) from None

        def cancel() -> None:
            for job in jobs:
                worker.cancel(job)

        if parsed.stream:
            return StreamingResponse(completions.stream(jobs[0], parsed, model, cancel),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(cancel))

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        result = await completions.complete(jobs, parsed, model, disconnected, worker.cancel)
        return JSONResponse(result.model_dump(mode="json"))


# --------------------------------------------------------------------------- `specfuse serve`


def run(config: ServerConfig) -> None:
    """Load the members (failing fast with a clear error), then serve until interrupted."""
    import uvicorn

    level = config.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(level)
    if config.server.host not in ("127.0.0.1", "localhost", "::1") and not config.server.api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use it",
                    config.server.host)
    log.info("loading members…")
    with load_ensemble(config) as ensemble:
        app = create_app(config, ensemble)
        s = config.server
        log.info("open http://%s:%d/ for the web view; API at /v1%s", s.host, s.port,
                 " (API key required)" if s.api_key else "")
        uvicorn.run(app, host=s.host, port=s.port, log_level=config.server.log_level,
                    timeout_graceful_shutdown=30)


__all__ = ["ServerState", "create_app", "load_ensemble", "run"]
