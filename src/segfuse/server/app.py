"""The FastAPI application: status and model routes, error handlers, and one router per API.

The server is cut by API, one folder each with its router (``routes``), wire
types (``protocol``) and answers (``serving``): ``chat`` (/v1/chat/completions),
``completions`` (/v1/completions, and the tokenizer routes beside it),
``messages`` (Anthropic's /v1/messages), ``responses`` (OpenAI's /v1/responses), ``ollama``
(Ollama's /api/chat, /api/generate and its model routes).
Under them, the shared part at this folder's root: ``state`` and ``serving``
(the server's state, a request's way to the worker, errors, request bodies,
SSE, disconnects), ``wire`` (the shapes every API shares), ``parsing`` and
``limits`` (reading and bounding requests). Beside them, two rooms that are no
API: ``worker/`` (the jobs, their bounded queue and the thread that runs them)
and ``models/`` (the models served, by name, and their members, loaded on
demand and freed when idle).

``create_app`` is what tests and embedders use; ``run`` is `segfuse serve`.
Members are loaded before the app starts (``run``) or, when the app is created
without an ensemble, in a background thread while /health says "loading" and
completions answer 503. /health and /metrics (Prometheus) need no API key, but
when the server has one, a request without it sees only /health's status and
no figure per member (none names a member, nor tells of other clients' prompts: docs/server.md, Metrics).

Client input is read within ``[limits]`` (``limits.py``), and parsed, checked
and compiled off the event loop (``ServerState.offload``), so that no request
can hold up the others' streams.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..backends.registry import estimate_bytes, load_member
from ..config import WILDCARD_HOSTS, ServerConfig
from ..ensemble import Ensemble
from ..errors import SegfuseError
from ..keep_alive import keep_alive_seconds
from ..member_options import MemberOptions
from .chat import routes as chat
from .completions import routes as completions
from .connections import h11_protocol
from .guards import Gate, quoted, redact
from .messages import routes as messages
from .messages.protocol import PATH as MESSAGES_PATH
from .messages.protocol import error_body as anthropic_error
from .models.catalog import Catalog
from .models.fit import check_all, sizes_of
from .models.on_request import load_model, unload_model
from .models.pool import Budget, Pool
from .models.view import memory_of, model_cards, model_state
from .ollama import routes as ollama
from .ollama.protocol import PREFIX as OLLAMA_PREFIX
from .ollama.protocol import error_body as ollama_error
from .responses import routes as responses
from .responses.store import ResponseStore
from .serving import APIError, api_error
from .shared import Shared, hedge_of
from .state import ServerState, key_check
from .wire import Health, HealthStatus, MemberOccupancy, ModelCard, ModelList, ModelState, QueueState
from .worker.periodic import saving_prefix_caches
from .worker.thread import Worker

log = logging.getLogger("segfuse.server")
STATIC = Path(__file__).with_name("static")
API_ROUTERS = (  # one per API
    chat.api_router,
    completions.api_router,
    messages.api_router,
    responses.api_router,
    ollama.api_router,
)


def load_ensemble(config: ServerConfig) -> Ensemble:
    """Load the configured members (the embedded three when none are named), carrying the Hedge weights
    over as the server would (``hedge_of``)."""
    persist, store = hedge_of(config)
    m = config.members
    return Ensemble(m.models or None, hedge_persist=persist, hedge_store=store, **member_options(config))


def member_options(config: ServerConfig) -> dict[str, Any]:
    """What every member is loaded with: [members]' options, one slot per generation in flight."""
    return {**config.members.load_options().given(), "slots": config.server.max_concurrent}


def pool_of(config: ServerConfig, worker: Worker, given: Ensemble | None) -> Pool:
    """The server's members: `given` (the caller's, kept) and what the catalog names, loaded on demand."""
    shared = MemberOptions.build(member_options(config))
    catalog = Catalog.of(config, given)
    s = config.server
    budget = Budget(s.max_loaded_members, s.budget_bytes())
    pool = Pool(catalog, worker, lambda spec: load_member(spec, shared), budget, keep_alive_seconds(s.keep_alive))
    if given is not None:
        pool.adopt(given.members)
    if budget.nbytes is not None:  # each member's size before it loads; what can never fit is refused here
        for place in pool.places.values():
            if place.spec is not None and place.nbytes is None:
                place.estimate = estimate_bytes(place.spec, shared)
        check_all(catalog, sizes_of(pool.places.values()), budget.nbytes)
    return pool


def create_app(config: ServerConfig, ensemble: Ensemble | None = None, shared: Shared | None = None) -> FastAPI:
    """The ASGI app. With ``ensemble`` given, it is the default model and the caller keeps ownership of
    it; the config's other models load on demand. Without, the models to preload load in a background
    thread (``preload`` loads them here and now instead). `shared`: what this app shares with other front
    ends of the same server (default: nothing, all in memory; ``shared.py``)."""
    worker = Worker(config.server.queue_size, config.server.max_concurrent, stall_after_s=config.server.stall_after_s)
    shared = shared if shared is not None else Shared(ResponseStore())
    pool = pool_of(config, worker, ensemble)
    state = ServerState(config, pool, shared.metrics(worker.queue), shared)
    worker.observer = state.metrics
    pool.ensemble.hedge_persist, pool.ensemble.hedge_store = hedge_of(config, shared, ensemble)
    if ensemble is not None:
        state.status = "ok" if ensemble.members else "failed"
        state.error = None if ensemble.members else "the ensemble has no members"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        _start(state)
        yield
        await asyncio.to_thread(state.worker.stop)
        pool.close()

    # No /docs or /redoc: their pages load scripts from a CDN, and the server must work offline.
    # /openapi.json is a route of ours, behind the key (_add_model_routes).
    app = FastAPI(
        title="segfuse",
        summary="OpenAI-compatible API of a segfuse ensemble",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.segfuse = state
    app.add_middleware(Gate, allowed=config.server.hosts(), max_header_bytes=config.limits.max_header_bytes)
    _add_error_handlers(app, state)
    _add_routes(app, state)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def preload(state: ServerState) -> None:
    """Load the models to preload, here and now (a SegfuseError says which could not load, and why)."""
    for name in state.catalog.preload:
        state.pool.load_now(state.catalog.models[name])
    state.status = "ok"


def _start(state: ServerState) -> None:
    """Start the worker and the pool; preload in the background unless it was done or nothing is to load."""
    pool, config = state.pool, state.config
    pool.start()
    state.worker.periodic = saving_prefix_caches(pool.loaded, config.server.prefix_cache_save_minutes)
    state.worker.start(pool.ensemble)
    state.metrics.members(state.members)
    if state.status == "loading":
        threading.Thread(target=_preload_in_background, args=(state,), name="segfuse-loader", daemon=True).start()
    log.info("serving %s (by default %s)", ", ".join(state.catalog.ensembles), state.model_id)


def _preload_in_background(state: ServerState) -> None:
    try:
        preload(state)
    except SegfuseError as exc:
        state.status, state.error = "failed", str(exc)
        log.error("could not load the members: %s", exc)
    except Exception as exc:  # report, keep the server up so /health can say why
        state.status, state.error = "failed", f"{type(exc).__name__}: {exc}"
        log.exception("could not load the members")


# --------------------------------------------------------------------------- errors


def _error_response(error: APIError, path: str = "") -> JSONResponse:
    """The error in the shape of the API the path belongs to (OpenAI's; Anthropic's under /v1/messages,
    Ollama's under /api/)."""
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    anthropic = path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")
    body = (
        anthropic_error(error) if anthropic else ollama_error(error) if path.startswith(OLLAMA_PREFIX) else error.body()
    )
    return JSONResponse(body, status_code=error.status, headers=headers)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        return _error_response(APIError(422, f"{where}: {first['msg']}", code="invalid_value"), request.url.path)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", quoted(request.url.path))
        return _error_response(api_error(exc, state.holds_key(request)), request.url.path)


# --------------------------------------------------------------------------- routes


def _add_routes(app: FastAPI, state: ServerState) -> None:
    require_key = Depends(key_check(state))
    _add_status_routes(app, state)
    _add_model_routes(app, state, require_key)
    for api_router in API_ROUTERS:
        app.include_router(api_router(state), dependencies=[require_key])
    app.include_router(ollama.version_router())  # open, as /health: Ollama's clients probe it


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """The web view, /health and /metrics: open, no request content; with a key set, what tells of other
    clients' requests only to requests that hold it."""
    worker = state.worker

    # HEAD too: Ollama's command line checks that a server is up with HEAD /.
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/health", response_model=Health)
    async def health(request: Request) -> JSONResponse:
        status: HealthStatus = state.status
        error = state.error
        if status == "ok" and worker.fatal is not None:  # the process exits: a supervisor restarts it
            status, error = "failed", f"the worker stopped: {worker.fatal}"
        elif status == "ok" and (stall := worker.stalled) is not None:
            status, error = "stalled", stall
        code = 200 if status == "ok" else 503
        if not state.sees_all(request):  # a probe: readiness only
            return JSONResponse({"status": status}, status_code=code)
        error = error if error is None or state.holds_key(request) else redact(error)
        waiting, running, occupancy = state.queue.view()
        copies = await state.shared.copies(state.loaded)
        body = Health(
            status=status,
            model=state.model_id,
            members=state.members,
            error=error,
            queue=QueueState(
                waiting=waiting,
                running=running,
                capacity=state.queue.queue_size,
                max_concurrent=state.queue.max_concurrent,
            ),
            counters=state.queue.snapshot(),
            placement=state.placement,
            occupancy={name: MemberOccupancy(**asdict(held)) for name, held in occupancy.items()},
            copies=copies.members,
            degraded=copies.degraded,
            replica=state.shared.replica,
            ensembles={name: list(state.catalog.models[name].members) for name in state.catalog.ensembles},
            memory=memory_of(state.pool, state.holds_key(request)),
        )
        return JSONResponse(body.model_dump(), status_code=code)

    # Open like /health, for scrapers: counts and timings only, no request content; every series per member
    # (its name, the prefix caches, the cells sessions hold) only with the key, when there is one.
    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        copies = await state.shared.copies(state.loaded)
        # Off the event loop: front ends that share their figures read the others' (server/ray/state.py).
        text = await asyncio.to_thread(state.metrics.render, state.sees_all(request), copies)
        return Response(text, media_type=state.metrics.content_type)


def _add_model_routes(app: FastAPI, state: ServerState, require_key: Any) -> None:
    @app.get("/openapi.json", include_in_schema=False, dependencies=[require_key])
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/v1/models", response_model=ModelList, dependencies=[require_key])
    async def list_models() -> ModelList:
        return ModelList(data=model_cards(state.pool, state.started))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=[require_key])
    async def get_model(model_id: str) -> ModelCard:
        for card in model_cards(state.pool, state.started):
            if card.id == model_id:
                return card
        raise APIError(404, f"unknown model {model_id!r}", code="model_not_found", param="model")

    _add_load_routes(app, state, require_key)


def _add_load_routes(app: FastAPI, state: ServerState, require_key: Any) -> None:
    """Load a model, or free it, without a generation; each answers where the model stands then."""

    @app.post("/v1/models/{model_id:path}/load", response_model=ModelState, dependencies=[require_key])
    async def load(model_id: str, keep_alive: str | None = None) -> ModelState:
        """Its members loaded now, then kept `keep_alive` (as a request's; absent: the model's, else the server's)."""
        try:
            chosen = state.catalog.model(model_id)
            keep = None if keep_alive is None else keep_alive_seconds(keep_alive)
            await load_model(state.pool, chosen, keep, state.config.limits.deadline_s)
        except SegfuseError as exc:
            raise api_error(exc, detailed=True) from None
        return model_state(state.pool, chosen)

    @app.post("/v1/models/{model_id:path}/unload", response_model=ModelState, dependencies=[require_key])
    async def unload(model_id: str, wait: float = Query(30.0, ge=0, le=3600)) -> ModelState:
        """Its members freed once no answer holds them, within `wait` seconds (else 409, and nothing in use goes)."""
        try:
            chosen = state.catalog.model(model_id)
            await unload_model(state.pool, chosen, wait)
        except SegfuseError as exc:
            raise api_error(exc, detailed=True) from None
        return model_state(state.pool, chosen)


# --------------------------------------------------------------------------- `segfuse serve`


def run(config: ServerConfig) -> None:
    """Load the members (failing fast with a clear error), then serve until interrupted (or until the
    worker cannot go on: then exit with status 1, for a supervisor to restart the server)."""
    configure_logging(config)
    log.info("loading members…")
    app = create_app(config)
    state: ServerState = app.state.segfuse
    try:
        preload(state)
        _serve(app, config)
    finally:
        state.pool.close()  # a no-op for what the app's shutdown closed


def _serve(app: FastAPI, config: ServerConfig) -> None:
    s = config.server
    log.info(
        "open http://%s:%d/ for the web view; API at /v1%s", s.host, s.port, " (API key required)" if s.api_key else ""
    )
    server = _server(app, config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C again once it has shut down (as uvicorn.run)
        pass
    if not server.started:
        raise SystemExit(3)  # as uvicorn.run: the port could not be bound
    fatal = app.state.segfuse.worker.fatal
    if fatal is not None:
        log.critical("exiting: the worker stopped (%s)", fatal)
        raise SystemExit(1)


def configure_logging(config: ServerConfig) -> None:
    """Log at ``[server] log_level``, and warn where the server is open to more than this machine."""
    level = config.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(level)
    if config.server.host not in ("127.0.0.1", "localhost", "::1") and not config.server.api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use it", config.server.host)
    hosts = config.server.hosts()
    if hosts is not None and config.server.allowed_hosts is None and config.server.host in WILDCARD_HOSTS:
        log.warning(
            "listening on every interface, answering only Host %s: name the others with --allowed-hosts",
            ", ".join(sorted(hosts - {config.server.host})),
        )


def _server(app: FastAPI, config: ServerConfig) -> Any:
    """uvicorn's Server for `app`: on SIGINT/SIGTERM the jobs in flight stop first, so that their streams
    end at once (with an error frame) instead of holding the graceful shutdown up; a worker that cannot
    go on stops it."""
    import uvicorn

    worker: Worker = app.state.segfuse.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Called as a signal handler: the worker's locks are taken in a thread of its own.
            threading.Thread(target=worker.queue.begin_shutdown, name="segfuse-shutdown", daemon=True).start()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, **uvicorn_settings(config)))
    worker.on_fatal = lambda reason: setattr(server, "should_exit", True)
    return server


def uvicorn_settings(config: ServerConfig) -> dict[str, Any]:
    """How uvicorn serves the app: the address, and the connection limits of ``[limits]`` (uvicorn's own
    ``limit_concurrency`` counts idle connections too: ours, in the protocol class, counts requests only)."""
    s, limits = config.server, config.limits
    return {
        "host": s.host,
        "port": s.port,
        "log_level": s.log_level,
        "timeout_graceful_shutdown": 30,
        "timeout_keep_alive": limits.timeout_keep_alive_s,
        "http": h11_protocol(limits),
        "h11_max_incomplete_event_size": limits.max_header_bytes,
    }


__all__ = ["ServerState", "configure_logging", "create_app", "load_ensemble", "run", "uvicorn_settings"]
