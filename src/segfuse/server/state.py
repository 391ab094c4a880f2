"""What the routes share: the server's state, and a request's way to the worker (members, jobs, room).

Every API's ``serving`` runs the same steps: read the body (``serving.json_body``),
parse it off the event loop (``ServerState.offload``), check the members are
ready and which answer (``require_members``, ``members_for``), then ``submit``
its jobs; the answer comes back through ``serving.finished`` or a stream.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fastapi import Request

from ..backends.base import Member
from ..config import ServerConfig
from ..errors import SegfuseError
from ..options import FusionOptions
from ..request import FusionRequest
from .guards import quoted, redact
from .metrics import ServerMetrics
from .serving import APIError, api_error, json_body
from .shared import Shared
from .worker import Job, Worker

log = logging.getLogger("segfuse.server")
PARSERS = 2  # requests parsed and compiled at once, off the event loop (the rest wait their turn)


@dataclass
class ServerState:
    """What the routes share: the config, the worker and whether members are ready."""

    config: ServerConfig
    defaults: FusionOptions
    worker: Worker
    metrics: ServerMetrics
    shared: Shared  # what other front ends of the server share (shared.py)
    status: Literal["ok", "loading", "failed"] = "loading"
    error: str | None = None
    members: list[str] = field(default_factory=list)
    placement: dict[str, str] = field(default_factory=dict)  # member -> where it runs, in words
    contexts: dict[str, int | None] = field(default_factory=dict)  # member -> one session's window, in tokens
    loaded: list[Member] = field(default_factory=list)  # the members themselves (prompt token counts)
    started: int = field(default_factory=lambda: int(time.time()))
    parsers: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(PARSERS))
    extras: dict[str, Any] = field(default_factory=dict)  # what one API keeps between requests (its store)

    @property
    def model_id(self) -> str:
        return self.config.server.model_id

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

    def context_length(self, model: str) -> int | None:
        """The prompt and answer a model takes, in tokens: a member's window, or for the fused model the
        smallest of its members' (every member reads the whole conversation)."""
        if model == self.model_id:
            known = [n for n in self.contexts.values() if n is not None]
            return min(known) if known and len(known) == len(self.contexts) else None
        return self.contexts.get(model)


def require_members(state: ServerState, detailed: bool) -> None:
    """503 while the members load, or when they could not."""
    if state.status == "loading":
        raise APIError(503, "the members are still loading; retry shortly", "server_error", "loading")
    if state.status == "failed":
        why = state.error or "unknown"
        raise APIError(503, f"no members available: {why if detailed else redact(why)}", "server_error", "no_members")


def members_for(state: ServerState, model: str) -> list[str] | None:
    """Who answers a request for `model`: every member (None) for the fused model, or one member alone."""
    if model == state.model_id:
        return None
    if model in state.members:
        return [model]
    raise APIError(
        404,
        f"unknown model {model!r}; this server serves {state.model_id!r} and its members {', '.join(state.members)}",
        code="model_not_found",
        param="model",
    )


def job_for(state: ServerState, request: FusionRequest, members: list[str] | None, **fields: Any) -> Job:
    """The worker's job for `request` (as its parsing made it), answered by `members` (None: every one)
    and accepted now: its deadline is ``[limits] request_timeout_s`` from now. `fields`: the server's own
    Job fields (tools, logprobs, id, work)."""
    accepted = time.monotonic()
    seconds = state.config.limits.deadline_s
    deadline = None if seconds is None else accepted + seconds
    return Job(replace(request, members=members, deadline=deadline), accepted_at=accepted, **fields)


def room(worker: Worker) -> int:
    """Places left for new jobs: the queue plus free slots, less those waiting (as ``Worker.submit`` counts)."""
    waiting, running = worker.state()
    return worker.queue_size + max(0, worker.max_concurrent - running) - waiting


def submit(
    state: ServerState, jobs: Sequence[Job], detailed: bool, user: str | None = None, param: str = "prompt"
) -> Callable[[], None]:
    """Queue a request's jobs, all or none (429 naming `param` when they do not all fit); returns what
    cancels them all (a no-op for those that ended)."""
    worker = state.worker
    if user:
        log.info("%s for user %s", jobs[0].id, quoted(user))
    free = room(worker)
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
            worker.submit(job)
    except SegfuseError as exc:
        for job in jobs:
            worker.cancel(job)
        raise api_error(exc, detailed) from None

    def cancel() -> None:
        for job in jobs:
            worker.cancel(job)

    return cancel


def key_check(
    state: ServerState, hint: str = "'Authorization: Bearer <key>' or 'x-api-key: <key>'"
) -> Callable[[Request], Awaitable[None]]:
    """The dependency that enforces the API key (none configured: every request passes)."""

    async def require_key(request: Request) -> None:
        if state.config.server.api_key is not None and not state.holds_key(request):
            raise APIError(401, f"missing or invalid API key; send {hint}", code="invalid_api_key")

    return require_key


__all__ = ["ServerState", "job_for", "key_check", "members_for", "require_members", "room", "submit"]
