"""What every endpoint shares: errors, reading a job's items, server-sent events, disconnects, bodies.

Each API's serving (``chat``, ``completions``, ``messages``, ``responses``) turns
its request into jobs, and its answer object (``answer.py``) the jobs' items into
its own wire shape; what they all need lives here, written once: ``APIError`` (sent in each API's own error
shape by the app), ``finished`` (the whole answer, cancelled when the client
hangs up), ``event_stream`` (SSE headers and the cancel-on-hangup), the
request body within ``[limits]``, and the counts every response's parts are
made of (a finish reason, a result's usage, a segment's record); what an
answer reports of its own result (its envelope, usage, ``segfuse`` object,
tool call) is its answer object's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from ..errors import (
    InvalidRequestError,
    MemberFailedError,
    MemberLoadError,
    NoFreeSlotError,
    SegfuseError,
    UnknownModelError,
)
from ..tools import ToolCall
from ..types import DoneEvent, Result, Segment
from .guards import media_type_error, redact
from .models.fit import ModelInUseError, TooLargeError
from .models.pool import LoadFailedError, MemberFreedError, NoRoomError
from .wire import ErrorDetail, ErrorResponse, SegmentInfo, Usage
from .worker.jobs import (
    Cancelled,
    DeadlineError,
    Failed,
    Job,
    QueueFullError,
    ShuttingDownError,
    Started,
    Worked,
    WorkerFailedError,
)

log = logging.getLogger("segfuse.server")

KEEPALIVE_S = 10.0  # an SSE comment this often keeps proxies from closing a queued stream
DRAIN_FACTOR = 16  # read (and drop) up to this many times the body limit, so the 413 reaches the client


class APIError(Exception):
    """An error to send with this HTTP status, in the shape of the API the request spoke (OpenAI's by
    default: ``body``; the app picks another API's shape by the request's path)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, code=code, param=param)

    @classmethod
    def invalid(cls, param: str, why: str) -> APIError:
        """400 ``invalid_value`` about one field of the request: "`param`: `why`"."""
        return cls(400, f"{param}: {why}", code="invalid_value", param=param)

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.detail).model_dump()


# What a client sees of each domain error: its status, type, code and param; the first that matches wins
# (NoFreeSlotError before MemberFailedError, its base). Any other SegfuseError: a 500 server_error.
ERRORS: tuple[tuple[type[SegfuseError] | tuple[type[SegfuseError], ...], int, str, str | None, str | None], ...] = (
    (QueueFullError, 429, "rate_limit_error", "queue_full", None),  # the worker's queue, or the pool's waiting room
    (ShuttingDownError, 503, "server_error", "shutting_down", None),
    (DeadlineError, 504, "server_error", "deadline_exceeded", None),
    (WorkerFailedError, 503, "server_error", "worker_failed", None),
    (UnknownModelError, 404, "invalid_request_error", "model_not_found", "model"),  # the catalog names no such model
    (InvalidRequestError, 400, "invalid_request_error", "invalid_request", None),
    (NoFreeSlotError, 503, "server_error", "no_free_slot", None),  # every slot held past the wait: busy, not broken
    ((MemberFailedError, MemberLoadError), 500, "server_error", "member_failed", None),
    (MemberFreedError, 503, "server_error", None, None),  # the pool's: a member given loaded, freed
    (LoadFailedError, 503, "server_error", "model_load_failed", "model"),
    (NoRoomError, 503, "server_error", "no_room", None),
    (TooLargeError, 400, "invalid_request_error", "model_too_large", "model"),  # never fits the memory budget
    (ModelInUseError, 409, "invalid_request_error", "model_in_use", "model"),  # asked to unload while it answers
)


def api_error(exc: BaseException, detailed: bool = False) -> APIError:
    """Map any exception to the APIError a client should see (no internals for bugs): a domain error as
    ``ERRORS`` says. Texts from inside (a member's fault, a load error) lose their paths and URLs unless
    `detailed` (the request holds the key)."""
    if isinstance(exc, APIError):
        return exc
    if not isinstance(exc, SegfuseError):
        return APIError(500, "internal error while generating; see the server log", "server_error")
    text = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
    text = text if detailed else redact(text)
    for kind, status, type_, code, param in ERRORS:
        if isinstance(exc, kind):
            return APIError(status, text, type_, code, param)
    return APIError(500, text, "server_error")


CANCELLED = "the generation was cancelled"


def failure_of(item: Any, detailed: bool = False) -> APIError | None:
    """The error a failed or cancelled job ends with (None for other items)."""
    if isinstance(item, Failed):
        return api_error(item.error, detailed)
    if isinstance(item, Cancelled):
        return APIError(503, CANCELLED, "server_error", "cancelled")
    return None


# --------------------------------------------------------------------------- request bodies


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
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
        raise APIError(
            408,
            f"the request body took longer than {timeout_s:g} s to arrive ([limits] body_timeout_s)",
            code="request_timeout",
        ) from None
    except ClientDisconnect:  # an answer nobody reads, rather than a traceback in the log per hang-up
        raise APIError(
            400, "the client closed the connection before its body arrived", code="client_disconnected"
        ) from None
    if too_big:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    return b"".join(parts)


async def json_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """A JSON endpoint's body: 415 unless it is declared JSON (browsers), then read within the limits."""
    why = media_type_error(request.headers.get("content-type"))
    if why is not None:
        raise APIError(415, why, code="unsupported_media_type")
    return await read_body(request, limit, timeout_s)


# --------------------------------------------------------------------------- what every response reports


def finish_reason_of(result: Result, call: ToolCall | None = None) -> str:
    """OpenAI's finish reason: "tool_calls", "stop" or "length" (a context or deadline end is a length limit)."""
    if call is not None:
        return "tool_calls"
    return "stop" if result.stats.finish_reason == "stop" else "length"


def usage_of(result: Result, started: Started | None) -> Usage:
    """A job's usage (`started`: its start, None if it never started). Members tokenize differently:
    count the longest prompt, and the winners' answer tokens."""
    prompt = max(started.prompt_tokens.values(), default=0) if started else 0
    return Usage(prompt_tokens=prompt, completion_tokens=result.stats.tokens, total_tokens=prompt + result.stats.tokens)


def segment_info(segment: Segment) -> SegmentInfo:
    """A segment's record in the ``segfuse`` object: its text, who wrote it, its round."""
    return SegmentInfo(text=segment.text, model=segment.model, round=segment.round)


# --------------------------------------------------------------------------- a job's answer


async def finished(
    job: Job, disconnected: Callable[[], Awaitable[None]], cancel: Callable[[], None], detailed: bool = False
) -> tuple[Result, Started | None]:
    """Wait for the whole answer; ``cancel()`` the job if the client goes away first.

    ``disconnected`` returns when the client hangs up; the worker then stops
    the job within a round and the item stream ends with ``Cancelled``.
    """

    item, started = await _last_item(job, disconnected, cancel, detailed)
    assert isinstance(item, DoneEvent)
    return item.result, started


async def worked(
    job: Job, disconnected: Callable[[], Awaitable[None]], cancel: Callable[[], None], detailed: bool = False
) -> object:
    """A work job's value (``Job.work``), as :func:`finished` waits for an answer."""
    item, _ = await _last_item(job, disconnected, cancel, detailed)
    assert isinstance(item, Worked)
    return item.value


async def _last_item(
    job: Job, disconnected: Callable[[], Awaitable[None]], cancel: Callable[[], None], detailed: bool
) -> tuple[DoneEvent | Worked, Started | None]:
    """The job's result item and its Started; its failure raised as an APIError."""

    async def watch() -> None:
        await disconnected()
        cancel()

    started: Started | None = None
    watcher = asyncio.ensure_future(watch())
    try:
        async for item in job.items():
            if isinstance(item, Started):
                started = item
            elif isinstance(item, DoneEvent | Worked):
                return item, started
            elif (error := failure_of(item, detailed)) is not None:
                raise error
        raise APIError(500, "the generation ended without a result", "server_error")
    finally:
        watcher.cancel()
        cancel()  # a no-op when the job already ended


def disconnected(request: Request) -> Callable[[], Awaitable[None]]:
    """A waiter that returns when the client of a non-streamed request hangs up (its work is then cancelled)."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


# --------------------------------------------------------------------------- server-sent events


def sse(payload: dict[str, Any] | str, event: str | None = None) -> str:
    """One SSE frame (``event``: its name, for the APIs that name their events)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


KEEPALIVE_FRAME = ": keep-alive\n\n"


def event_stream(events: AsyncIterator[str], cancel: Callable[[], None]) -> StreamingResponse:
    """A request's server-sent events; `cancel` also runs when the client hung up."""
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(cancel),
    )


__all__ = [
    "KEEPALIVE_FRAME",
    "KEEPALIVE_S",
    "APIError",
    "api_error",
    "disconnected",
    "event_stream",
    "failure_of",
    "finish_reason_of",
    "finished",
    "json_body",
    "read_body",
    "segment_info",
    "sse",
    "usage_of",
    "worked",
]
