"""The FastAPI application: thin routes over ``serving`` and the worker.

``create_app`` is what tests and embedders use; ``run`` is `specfuse serve`.
Members are loaded before the app starts (``run``) or, when the app is created
without an ensemble, in a background thread while /health says "loading" and
completions answer 503. /health and /metrics (Prometheus) need no API key, but
when the server has one, a request without it sees only /health's status and
no figure that tells of other clients' prompts (docs/server.md, Privacy).

Client input is read within ``[limits]`` (``limits.py``), and parsed, checked
and compiled off the event loop (``ServerState.offload``), so that no request
can hold up the others' streams.
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
from .config import WILDCARD_HOSTS, ServerConfig
from .guards import Gate, h11_protocol, media_type_error, quoted, redact
from .metrics import ServerMetrics
from .protocol import Health, MemberOccupancy, ModelCard, ModelList, QueueState
from .serving import APIError
from .worker import Job, Worker

log = logging.getLogger("specfuse.server")
STATIC = Path(__file__).with_name("static")
DRAIN_FACTOR = 16  # read (and drop) up to this many times the body limit, so the 413 reaches the client
PARSERS = 2  # requests parsed and compiled at once, off the event loop (the rest wait their turn)


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
    placement: dict[str, str] = field(default_factory=dict)  # member -> where it runs, in words
    started: int = field(default_factory=lambda: int(time.time()))
    parsers: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(PARSERS))

    @property
    def model_id(self) -> str:
        return self.config.server.model_id

    async def offload(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)`` in a thread, at most ``PARSERS`` at once: CPU work on client input never runs on
        the event loop, which must keep every stream and /health moving."""
        async with self.parsers:
            return await asyncio.to_thread(work, *args)

    def holds_key(self, request: Request) -> bool:
        """Whether the request carries this server's API key (never, on a server without one)."""
        key = self.config.server.api_key
        if key is None:
            return False
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())

    def sees_all(self, request: Request) -> bool:
        """Whether the request may see figures about other clients' requests: it holds the key, or there is none."""
        return self.config.server.api_key is None or self.holds_key(request)


def load_ensemble(config: ServerConfig) -> Ensemble:
    """Load the configured members (the embedded three when none are named)."""
    m = config.members
    options = {**m.load_options().given(), "slots": config.server.max_concurrent}  # one slot per generation in flight
    return Ensemble(m.models or None, hedge_persist=config.server.hedge_persist, **options)


def create_app(config: ServerConfig, ensemble: Ensemble | None = None) -> FastAPI:
    """The ASGI app. With ``ensemble`` given the caller keeps ownership of it."""
    worker = Worker(config.server.queue_size, config.server.max_concurrent,
                    stall_after_s=config.server.stall_after_s)
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
        state.placement = {m.name: m.placement or "?" for m in ens.members}
        log.info("serving %s with members %s", state.model_id,
                 ", ".join(f"{name} ({where})" for name, where in state.placement.items()))

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
    # /openapi.json is a route of ours, behind the key (_add_model_routes).
    app = FastAPI(title="SpecFuse", summary="OpenAI-compatible API of a SpecFuse ensemble",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specfuse = state
    app.add_middleware(Gate, allowed=config.server.hosts(), max_header_bytes=config.limits.max_header_bytes)
    _add_error_handlers(app, state)
    _add_routes(app, state)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


# --------------------------------------------------------------------------- errors


def _error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
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
        log.exception("unhandled error on %s", quoted(request.url.path))
        return _error_response(serving.api_error(exc, state.holds_key(request)))


# --------------------------------------------------------------------------- routes


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, or 413 once it passes ``limit`` bytes (drained a while so the client sees the 413), or 408
    when the client takes longer than ``timeout_s`` to send it (a slow client must not hold a connection)."""
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    too_big = True
                if too_big:
                    if size > DRAIN_FACTOR * limit:
                        break
                    continue
                parts.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body took longer than {timeout_s:g} s to arrive ([limits] "
                       "body_timeout_s)", code="request_timeout") from None
    if too_big:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    return b"".join(parts)


async def _json_body(request: Request, state: ServerState) -> bytes:
    """A JSON endpoint's body: 415 unless it is declared JSON (browsers), then read within the limits."""
    why = media_type_error(request.headers.get("content-type"))
    if why is not None:
        raise APIError(415, why, code="unsupported_media_type")
    return await _read_body(request, state.config.server.max_body_bytes, state.config.limits.body_timeout_s)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    require_key = Depends(_key_check(state))
    _add_status_routes(app, state)
    _add_model_routes(app, state, require_key)
    _add_completion_route(app, state, require_key)
    _add_text_completion_route(app, state, require_key)


def _key_check(state: ServerState) -> Callable[[Request], Awaitable[None]]:
    """The dependency that enforces the API key (none configured: every request passes)."""

    async def require_key(request: Request) -> None:
        if state.config.server.api_key is not None and not state.holds_key(request):
            raise APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    return require_key


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """The web view, /health and /metrics: open, no request content; with a key set, what tells of other
    clients' requests only to requests that hold it."""
    worker = state.worker

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/health", response_model=Health)
    async def health(request: Request) -> JSONResponse:
        status, error = state.status, state.error
        if status == "ok" and worker.fatal is not None:  # the process exits: a supervisor restarts it
            status, error = "failed", f"the worker stopped: {worker.fatal}"
        elif status == "ok" and (stall := worker.stalled) is not None:
            status, error = "stalled", stall
        code = 200 if status == "ok" else 503
        if not state.sees_all(request):  # a probe: readiness only
            return JSONResponse({"status": status}, status_code=code)
        error = error if error is None or state.holds_key(request) else redact(error)
        waiting, running = worker.state()
        body = Health(status=status, model=state.model_id, members=state.members, error=error,
                      queue=QueueState(waiting=waiting, running=running, capacity=worker.queue_size,
                                       max_concurrent=worker.max_concurrent),
                      counters=worker.snapshot(), placement=state.placement,
                      occupancy={name: MemberOccupancy(**asdict(held)) for name, held in worker.occupancy().items()})
        return JSONResponse(body.model_dump(), status_code=code)

    # Open like /health, for scrapers: counts and timings only, no request content; the figures that tell of
    # other clients' prompts (the prefix caches, the cells sessions hold) only with the key, when there is one.
    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(private=state.sees_all(request)),
                        media_type=state.metrics.content_type)


def _model_cards(state: ServerState) -> list[ModelCard]:
    """The fused model, then each member (a member alone is a model of its own: a baseline)."""
    cards = [ModelCard(id=state.model_id, created=state.started, members=state.members)]
    cards += [ModelCard(id=name, created=state.started, parent=state.model_id) for name in state.members]
    return cards


def _add_model_routes(app: FastAPI, state: ServerState, require_key: Any) -> None:
    @app.get("/openapi.json", include_in_schema=False, dependencies=[require_key])
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/v1/models", response_model=ModelList, dependencies=[require_key])
    async def list_models() -> ModelList:
        return ModelList(data=_model_cards(state))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=[require_key])
    async def get_model(model_id: str) -> ModelCard:
        for card in _model_cards(state):
            if card.id == model_id:
                return card
        raise APIError(404, f"unknown model {model_id!r}", code="model_not_found", param="model")


def _require_members(state: ServerState, detailed: bool) -> None:
    if state.status == "loading":
        raise APIError(503, "the members are still loading; retry shortly", "server_error", "loading")
    if state.status == "failed":
        why = state.error or "unknown"
        raise APIError(503, f"no members available: {why if detailed else redact(why)}", "server_error",
                       "no_members")


def _members_for(state: ServerState, model: str) -> list[str] | None:
    """Who answers a request for `model`: every member (None) for the fused model, or one member alone."""
    if model == state.model_id:
        return None
    if model in state.members:
        return [model]
    raise APIError(404, f"unknown model {model!r}; this server serves {state.model_id!r} "
                   f"and its members {', '.join(state.members)}", code="model_not_found", param="model")


def _job_fields(state: ServerState, request: Any) -> dict[str, Any]:
    """What every job of a request carries besides its content: the deadline and the cache salt."""
    return {"deadline_s": state.config.limits.deadline_s, "cache_salt": request.cache_salt}


def _room(worker: Worker) -> int:
    """Places left for new jobs: the queue plus free slots, less those waiting (as ``Worker.submit`` counts)."""
    waiting, running = worker.state()
    return worker.queue_size + max(0, worker.max_concurrent - running) - waiting


def _event_stream(events: AsyncIterator[str], cancel: Callable[[], None]) -> StreamingResponse:
    """A request's server-sent events; `cancel` also runs when the client hung up."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(cancel))


def _disconnected(request: Request) -> Callable[[], Awaitable[None]]:
    """A waiter that returns when the client of a non-streamed request hangs up (its work is then cancelled)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return disconnected


def _add_completion_route(app: FastAPI, state: ServerState, require_key: Any) -> None:
    worker = state.worker

    # The body is parsed by hand (parsing.plan_chat) to tell bad JSON (400) from a bad shape (422).
    @app.post("/v1/chat/completions", dependencies=[require_key])
    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request, state)
        plan = await state.offload(parsing.plan_chat, body, state.defaults, state.config.limits)
        detailed = state.holds_key(request)
        _require_members(state, detailed)
        parsed = plan.request
        model = parsed.model or state.model_id
        job = Job(plan.messages, plan.options, _members_for(state, model), plan.constraint, plan.tools,
                  logprobs=plan.top_logprobs is not None, top_logprobs=plan.top_logprobs or 0,
                  **_job_fields(state, parsed))
        if parsed.user:
            log.info("%s for user %s", job.id, quoted(parsed.user))
        job.bind(asyncio.get_running_loop())
        try:
            worker.submit(job)
        except SpecFuseError as exc:
            raise serving.api_error(exc, detailed) from None

        def cancel() -> None:
            worker.cancel(job)

        if parsed.stream:
            return _event_stream(serving.stream(job, model, parsed.include_usage, cancel, detailed), cancel)
        result = await serving.complete(job, model, _disconnected(request), cancel, detailed)
        return JSONResponse(result.model_dump(mode="json"))


def _add_text_completion_route(app: FastAPI, state: ServerState, require_key: Any) -> None:
    worker = state.worker

    @app.post("/v1/completions", dependencies=[require_key])
    async def text_completions(request: Request) -> Response:
        body = await _json_body(request, state)
        parsed = await state.offload(parsing.parse_request, body, completions.COMPLETIONS, state.config.limits)
        detailed = state.holds_key(request)
        _require_members(state, detailed)
        model = parsed.model or state.model_id
        jobs = completions.jobs_of(parsed, state.defaults, _members_for(state, model), **_job_fields(state, parsed))
        if parsed.user:
            log.info("%s for user %s", jobs[0].id, quoted(parsed.user))
        # Each prompt takes a place in the queue: all of them fit, or the request is refused whole.
        room = _room(worker)
        if len(jobs) > room:
            raise APIError(429, f"prompt: {len(jobs)} prompts need {len(jobs)} places in the queue and "
                           f"{max(0, room)} are free; retry in a little while, or send fewer at once",
                           "rate_limit_error", "queue_full", param="prompt")
        loop = asyncio.get_running_loop()
        try:
            for job in jobs:
                job.bind(loop)
                worker.submit(job)
        except SpecFuseError as exc:
            for job in jobs:
                worker.cancel(job)
            raise serving.api_error(exc, detailed) from None

        def cancel() -> None:
            for job in jobs:
                worker.cancel(job)

        if parsed.stream:
            return _event_stream(completions.stream(jobs[0], parsed, model, cancel, detailed), cancel)
        result = await completions.complete(jobs, parsed, model, _disconnected(request), worker.cancel, detailed)
        return JSONResponse(result.model_dump(mode="json"))


# --------------------------------------------------------------------------- `specfuse serve`


def run(config: ServerConfig) -> None:
    """Load the members (failing fast with a clear error), then serve until interrupted (or until the
    worker cannot go on: then exit with status 1, for a supervisor to restart the server)."""
    level = config.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(level)
    if config.server.host not in ("127.0.0.1", "localhost", "::1") and not config.server.api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use it",
                    config.server.host)
    hosts = config.server.hosts()
    if hosts is not None and config.server.allowed_hosts is None and config.server.host in WILDCARD_HOSTS:
        log.warning("listening on every interface, answering only Host %s: name the others with --allowed-hosts",
                    ", ".join(sorted(hosts - {config.server.host})))
    log.info("loading members…")
    with load_ensemble(config) as ensemble:
        app = create_app(config, ensemble)
        s = config.server
        log.info("open http://%s:%d/ for the web view; API at /v1%s", s.host, s.port,
                 " (API key required)" if s.api_key else "")
        server = _server(app, config)
        try:
            server.run()
        except KeyboardInterrupt:  # uvicorn raises the Ctrl-C again once it has shut down (as uvicorn.run)
            pass
        if not server.started:
            raise SystemExit(3)  # as uvicorn.run: the port could not be bound
        fatal = app.state.specfuse.worker.fatal
        if fatal is not None:
            log.critical("exiting: the worker stopped (%s)", fatal)
            raise SystemExit(1)


def _server(app: FastAPI, config: ServerConfig) -> Any:
    """uvicorn's Server for `app`: on SIGINT/SIGTERM the jobs in flight stop first, so that their streams
    end at once (with an error frame) instead of holding the graceful shutdown up; a worker that cannot
    go on stops it."""
    import uvicorn

    worker: Worker = app.state.specfuse.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Called as a signal handler: the worker's locks are taken in a thread of its own.
            threading.Thread(target=worker.begin_shutdown, name="specfuse-shutdown", daemon=True).start()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, **uvicorn_settings(config)))
    worker.on_fatal = lambda reason: setattr(server, "should_exit", True)
    return server


def uvicorn_settings(config: ServerConfig) -> dict[str, Any]:
    """How uvicorn serves the app: the address, and the connection limits of ``[limits]``."""
    s, limits = config.server, config.limits
    return {"host": s.host, "port": s.port, "log_level": s.log_level, "timeout_graceful_shutdown": 30,
            "limit_concurrency": limits.limit_concurrency, "timeout_keep_alive": limits.timeout_keep_alive_s,
            "http": h11_protocol(limits.header_timeout_s), "h11_max_incomplete_event_size": limits.max_header_bytes}


__all__ = ["ServerState", "create_app", "load_ensemble", "run", "uvicorn_settings"]
