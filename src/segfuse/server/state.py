"""What the routes share: the server's state, and a request's way to the worker (members, jobs, room).

Every API's ``serving`` runs the same steps: read the body (``serving.json_body``),
parse it off the event loop (``ServerState.offload``), check the server is
ready (``require_members``), take a lease on the model's members (``using``:
loads what is missing, ``models/pool.py``), then ``submit`` its jobs, each holding the
lease until the worker lets it go; the answer comes back through
``serving.finished`` or a stream.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal

from fastapi import Request

from ..backends.base import Member
from ..config import ServerConfig
from ..errors import InvalidRequestError, SegfuseError
from ..keep_alive import keep_alive_seconds
from ..request import FusionRequest
from .guards import quoted, redact
from .metrics import ServerMetrics
from .models.catalog import Catalog
from .models.pool import Lease, Pool
from .parsing import Defaults
from .serving import APIError, api_error, json_body
from .shared import Shared
from .worker.job_queue import JobQueue
from .worker.jobs import Job
from .worker.thread import Worker

log = logging.getLogger("segfuse.server")
PARSERS = 2  # requests parsed and compiled at once, off the event loop (the rest wait their turn)


@dataclass
class ServerState:
    """What the routes share: the config, the models and their pool, the worker, and whether the
    models loaded at start are ready."""

    config: ServerConfig
    pool: Pool  # the members, loaded on demand (its catalog: the models served)
    metrics: ServerMetrics
    shared: Shared  # what other front ends of the server share (shared.py)
    status: Literal["ok", "loading", "failed"] = "loading"
    error: str | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    parsers: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(PARSERS))
    extras: dict[str, Any] = field(default_factory=dict)  # what one API keeps between requests (its store)

    @property
    def worker(self) -> Worker:
        return self.pool.worker

    @property
    def queue(self) -> JobQueue:
        """The worker's queue: where requests submit and cancel their jobs, and what it holds."""
        return self.pool.worker.queue

    @property
    def catalog(self) -> Catalog:
        return self.pool.catalog

    @property
    def model_id(self) -> str:
        """The model of requests that name none."""
        return self.catalog.default

    @cached_property
    def defaults(self) -> Defaults:
        """Each model's fusion defaults, by the name a request gives."""
        return Defaults({name: m.defaults for name, m in self.catalog.models.items()}, self.catalog.default)

    @property
    def members(self) -> list[str]:
        """Every member the server may load, by name."""
        return list(self.pool.places)

    @property
    def loaded(self) -> list[Member]:
        """The members loaded now."""
        return self.pool.loaded()

    @property
    def placement(self) -> dict[str, str]:
        """Where each loaded member runs, in words."""
        return {m.name: m.placement or "?" for m in self.loaded}

    async def offload(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)`` in a thread, at most ``PARSERS`` at once: CPU work on client input never runs on
        the event loop, which must keep every stream and /health moving."""
        async with self.parsers:
            return await asyncio.to_thread(work, *args)

    def holds_key(self, request: Request) -> bool:
        """Whether the request carries this server's API key, as ``Authorization: Bearer`` (OpenAI) or
        ``x-api-key`` (Anthropic); never, on a server without one."""
        key = self.config.server.api_key
        if key is None:
            return False
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode()):
            return True
        given = request.headers.get("x-api-key")
        return given is not None and secrets.compare_digest(given.strip().encode(), key.encode())

    def sees_all(self, request: Request) -> bool:
        """Whether the request may see figures about other clients' requests: it holds the key, or there is none."""
        return self.config.server.api_key is None or self.holds_key(request)

    async def body(self, request: Request) -> bytes:
        """A JSON request body within ``[server] max_body_bytes`` and ``[limits] body_timeout_s``."""
        return await json_body(request, self.config.server.max_body_bytes, self.config.limits.body_timeout_s)

    def members_of(self, lease: Lease) -> list[Member]:
        """The loaded members a lease holds, in its model's order."""
        by_name = {m.name: m for m in self.loaded}
        return [by_name[name] for name in lease.model.members if name in by_name]


def require_members(state: ServerState, detailed: bool) -> None:
    """503 while the members load, or when they could not."""
    if state.status == "loading":
        raise APIError(503, "the members are still loading; retry shortly", "server_error", "loading")
    if state.status == "failed":
        why = state.error or "unknown"
        raise APIError(503, f"no members available: {why if detailed else redact(why)}", "server_error", "no_members")


@asynccontextmanager
async def using(state: ServerState, model: str | None, keep_alive: str | float | None = None) -> AsyncIterator[Lease]:
    """The members of `model` (None: the default), loaded if they were not and held while the request
    queues its jobs (404 for an unknown model; 400 for a bad keep_alive; the pool's errors as ``api_error``
    maps them: 429 while too many wait to load, 503 when a member cannot be loaded or does not fit)."""
    async with AsyncExitStack() as held:
        try:
            chosen = state.catalog.model(model)
            keep = keep_seconds(keep_alive)
            lease = await held.enter_async_context(state.pool.lease(chosen, keep, state.config.limits.deadline_s))
        except SegfuseError as exc:
            # The catalog's and the pool's texts name only models and members the server lists anyway (a load's
            # fault is redacted where it is written): sent whole, as for a request that holds the key.
            raise api_error(exc, detailed=True) from None
        yield lease


def keep_seconds(keep_alive: str | float | None) -> float | None:
    """A request's keep_alive in seconds (None: the server's); 400 naming it when it is no duration."""
    try:
        return None if keep_alive is None else keep_alive_seconds(keep_alive)
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message}; {exc.hint}", code="invalid_value", param="keep_alive") from None


def job_for(request: FusionRequest, lease: Lease, **fields: Any) -> Job:
    """The worker's job for `request` (as its parsing made it), answered by the lease's members, with the
    lease's deadline: ``[limits] request_timeout_s`` from when the request took it (the wait for its members
    to load counts). `fields`: the server's own Job fields (tools, logprobs, id, work)."""
    fusion = replace(request, members=lease.members, deadline=lease.deadline)
    return Job(fusion, accepted_at=lease.arrived, **fields)


def room(queue: JobQueue) -> int:
    """Places left for new jobs: the queue plus free slots, less those waiting (as ``JobQueue.submit`` counts)."""
    waiting, running = queue.state()
    return queue.queue_size + max(0, queue.max_concurrent - running) - waiting


def submit(
    state: ServerState,
    jobs: Sequence[Job],
    lease: Lease,
    detailed: bool,
    user: str | None = None,
    param: str = "prompt",
) -> Callable[[], None]:
    """Queue a request's jobs, all or none (429 naming `param` when they do not all fit), each holding
    the `lease` until the worker lets it go; returns what cancels them all (a no-op for those that ended)."""
    queue = state.queue
    if user:
        log.info("%s for user %s", jobs[0].id, quoted(user))
    free = room(queue)
    if len(jobs) > 1 and len(jobs) > free:
        raise APIError(
            429,
            f"{param}: {len(jobs)} prompts need {len(jobs)} places in the queue and "
            f"{max(0, free)} are free; retry in a little while, or send fewer at once",
            "rate_limit_error",
            "queue_full",
            param=param,
        )
    loop = asyncio.get_running_loop()
    try:
        for job in jobs:
            job.bind(loop)
            job.on_over = lease.hold()
            queue.submit(job)
    except SegfuseError as exc:
        for job in jobs:
            queue.cancel(job)
            job.over()  # a no-op for those the worker let go already
        raise api_error(exc, detailed) from None

    def cancel() -> None:
        for job in jobs:
            queue.cancel(job)

    return cancel


def key_check(
    state: ServerState, hint: str = "'Authorization: Bearer <key>' or 'x-api-key: <key>'"
) -> Callable[[Request], Awaitable[None]]:
    """The dependency that enforces the API key (none configured: every request passes)."""

    async def require_key(request: Request) -> None:
        if state.config.server.api_key is not None and not state.holds_key(request):
            raise APIError(401, f"missing or invalid API key; send {hint}", code="invalid_api_key")

    return require_key


__all__ = ["ServerState", "job_for", "keep_seconds", "key_check", "require_members", "room", "submit", "using"]
