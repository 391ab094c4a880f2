"""A job's events -> an OpenAI response body or SSE chunks (requests are read in ``parsing``).

Streaming and non-streaming read the same item iterator (``Job.items``), so the
two can only differ in framing. Everything here raises ``APIError``, which the
app turns into OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

from ..tools import ToolCall, read_call
from ..errors import (
    InvalidRequestError,
    MemberFailedError,
    MemberLoadError,
    NoFreeSlotError,
    SpecFuseError,
    UnknownModelError,
)
from ..logprobs import TokenLogprob, answer_logprobs
from ..types import DoneEvent, Result, RoundEvent, Segment, SegmentEvent
from .protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    ErrorDetail,
    ErrorResponse,
    FusionInfo,
    FusionStats,
    RoundInfo,
    SegmentInfo,
    TokenLogprobInfo,
    TopLogprob,
    Usage,
)
from .guards import redact
from .worker import (
    Cancelled,
    DeadlineError,
    Failed,
    Job,
    QueueFullError,
    ShuttingDownError,
    Started,
    WorkerFailedError,
)

log = logging.getLogger("specfuse.server")

KEEPALIVE_S = 10.0  # an SSE comment this often keeps proxies from closing a queued stream


class APIError(Exception):
    """An error to send as OpenAI error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, code=code, param=param)

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.detail).model_dump()


def api_error(exc: BaseException, detailed: bool = False) -> APIError:
    """Map any exception to the APIError a client should see (no internals for bugs). Texts from inside
    (a member's fault, a load error) lose their paths and URLs unless `detailed` (the request holds the key)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SpecFuseError):
        text = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
        text = text if detailed else redact(text)
        if isinstance(exc, QueueFullError):
            return APIError(429, text, "rate_limit_error", "queue_full")
        if isinstance(exc, ShuttingDownError):
            return APIError(503, text, "server_error", "shutting_down")
        if isinstance(exc, DeadlineError):
            return APIError(504, text, "server_error", "deadline_exceeded")
        if isinstance(exc, WorkerFailedError):
            return APIError(503, text, "server_error", "worker_failed")
        if isinstance(exc, UnknownModelError):
            return APIError(404, text, "invalid_request_error", "model_not_found", "model")
        if isinstance(exc, InvalidRequestError):
            return APIError(400, text, "invalid_request_error", "invalid_request")
        if isinstance(exc, NoFreeSlotError):  # every slot held past the wait: busy, not broken
            return APIError(503, text, "server_error", "no_free_slot")
        if isinstance(exc, MemberFailedError | MemberLoadError):
            return APIError(500, text, "server_error", "member_failed")
        return APIError(500, text, "server_error")
    return APIError(500, "internal error while generating; see the server log", "server_error")


# --------------------------------------------------------------------------- responses


def finish_reason_of(result: Result, call: ToolCall | None = None) -> str:
    if call is not None:
        return "tool_calls"
    return "stop" if result.stats.finish_reason == "stop" else "length"  # "context" is a length limit


def _call_of(job: Job, result: Result) -> ToolCall | None:
    """The tool call a finished answer makes, when tools were offered."""
    return read_call(result.text, job.tools) if job.tools and result.stats.finish_reason == "stop" else None


def _calls(call: ToolCall, index: int | None = None) -> list[dict[str, Any]]:
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return [entry if index is None else {"index": index, **entry}]


def usage_of(result: Result, started: Started | None) -> Usage:
    # Members tokenize differently: count the longest prompt, and the winners' answer tokens.
    prompt = max(started.prompt_tokens.values(), default=0) if started else 0
    return Usage(prompt_tokens=prompt, completion_tokens=result.stats.tokens,
                 total_tokens=prompt + result.stats.tokens)


def _stats(result: Result, started: Started | None) -> FusionStats:
    return FusionStats(**result.stats.to_dict(), queue_s=round(started.queue_s, 3) if started else 0.0)


def result_info(result: Result, started: Started | None, detailed: bool = False) -> FusionInfo:
    """The parts of a finished result every response carries (members, stats, weights, departures; a
    departure's reason without paths and URLs unless `detailed`)."""
    departures = [asdict(d) for d in result.departures]
    if not detailed:
        departures = [{**d, "reason": redact(str(d.get("reason") or ""))} for d in departures]
    return FusionInfo(
        members=result.models,
        stats=_stats(result, started),
        weights=result.weights or None,
        departures=departures or None,
    )


def segment_info(segment: Segment) -> SegmentInfo:
    return SegmentInfo(text=segment.text, model=segment.model, round=segment.round)


def completion_body(job: Job, model: str, result: Result, started: Started | None,
                    detailed: bool = False) -> ChatCompletion:
    return ChatCompletion(
        id=job.id,
        created=int(job.created),
        model=model,
        choices=[_choice(job, result)],
        usage=usage_of(result, started),
        specfuse=result_info(result, started, detailed).model_copy(update={
            "segments": [segment_info(s) for s in result.segments],
            "rounds": [RoundInfo.model_validate(r.to_dict()) for r in result.rounds],
            "prompt_tokens": started.prompt_tokens if started else None,
        }),
    )


def _choice(job: Job, result: Result) -> Choice:
    call = _call_of(job, result)
    message = (AssistantMessage(content=None, tool_calls=_calls(call)) if call
               else AssistantMessage(content=result.text))
    logprobs = None
    if job.logprobs:
        logprobs = ChoiceLogprobs(content=None if call else chat_logprobs(result.logprobs(), job.top_logprobs))
    return Choice(message=message, finish_reason=finish_reason_of(result, call), logprobs=logprobs)


def chat_logprobs(tokens: list[TokenLogprob], k: int) -> list[TokenLogprobInfo]:
    """Answer tokens in the chat shape: text, log-probability, bytes, the author's top `k`, who wrote it."""
    return [TokenLogprobInfo(token=t.text, logprob=t.logprob, bytes=list(t.bytes), model=t.model,
                             top_logprobs=[TopLogprob(token=text, logprob=lp, bytes=list(data))
                                           for text, data, lp in t.top[:k]])
            for t in tokens]


async def finished(job: Job, disconnected: Callable[[], Awaitable[None]],
                   cancel: Callable[[], None], detailed: bool = False) -> tuple[Result, Started | None]:
    """Wait for the whole answer; ``cancel()`` the job if the client goes away first.

    ``disconnected`` returns when the client hangs up; the worker then stops
    the job within a round and the item stream ends with ``Cancelled``.
    """

    async def watch() -> None:
        await disconnected()
        cancel()

    started: Started | None = None
    watcher = asyncio.ensure_future(watch())
    try:
        async for item in job.items():
            if isinstance(item, Started):
                started = item
            elif isinstance(item, DoneEvent):
                return item.result, started
            elif isinstance(item, Failed):
                raise api_error(item.error, detailed)
            elif isinstance(item, Cancelled):
                raise APIError(503, "the generation was cancelled", "server_error", "cancelled")
        raise APIError(500, "the generation ended without a result", "server_error")
    finally:
        watcher.cancel()
        cancel()  # a no-op when the job already ended


async def complete(job: Job, model: str, disconnected: Callable[[], Awaitable[None]],
                   cancel: Callable[[], None], detailed: bool = False) -> ChatCompletion:
    """The chat completion of the whole answer (see ``finished``)."""
    result, started = await finished(job, disconnected, cancel, detailed)
    return completion_body(job, model, result, started, detailed)


def failure_frame(item: Any, detailed: bool = False) -> str | None:
    """The SSE error event that ends a stream whose job failed or was cancelled (None for other items)."""
    if isinstance(item, Failed):
        return sse(api_error(item.error, detailed).body())
    if isinstance(item, Cancelled):
        return sse(APIError(503, "the generation was cancelled", "server_error", "cancelled").body())
    return None


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def _chunk(job: Job, model: str, delta: Delta, finish: str | None = None,
           info: FusionInfo | None = None, logprobs: ChoiceLogprobs | None = None) -> str:
    chunk = ChatCompletionChunk(id=job.id, created=int(job.created), model=model,
                                choices=[ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)],
                                specfuse=info)
    return sse(chunk.model_dump(mode="json", exclude={"usage"}))


async def stream(job: Job, model: str, include_usage: bool, cancel: Callable[[], None],
                 detailed: bool = False) -> AsyncIterator[str]:
    """SSE frames: role chunk, one delta per accepted segment, finish, [usage], [DONE].

    A failure after the stream began is sent as an ``error`` event; ``[DONE]``
    always ends the stream. If the client disconnects, the server cancels this
    generator at its current await and ``finally`` cancels the job.
    """
    yield _chunk(job, model, Delta(role="assistant", content=""), info=FusionInfo())
    started: Started | None = None
    pending: Segment | None = None
    held: list[str] = []  # with tools offered: the answer's text until it is known to be a call or not
    try:
        async for item in job.items(keepalive_s=KEEPALIVE_S):
            if item is None:
                yield ": keep-alive\n\n"
            elif isinstance(item, Started):
                started = item
                yield _chunk(job, model, Delta(), info=FusionInfo(prompt_tokens=item.prompt_tokens))
            elif isinstance(item, SegmentEvent):
                pending = item.segment  # sent with its round record, which follows at once
                if job.tools:  # the answer may be a call: its text is sent at the end, as a call or as text
                    held.append(pending.text)
                    pending = None
            elif isinstance(item, RoundEvent):
                round_info = RoundInfo.model_validate(item.record.to_dict())
                if pending is not None:
                    logprobs = (ChoiceLogprobs(content=chat_logprobs(answer_logprobs([pending]), job.top_logprobs))
                                if job.logprobs else None)
                    yield _chunk(job, model, Delta(content=pending.text),
                                 info=FusionInfo(segment=segment_info(pending), round=round_info), logprobs=logprobs)
                    pending = None
                else:  # a round whose winner was "stop here": no text, still worth showing
                    yield _chunk(job, model, Delta(), info=FusionInfo(round=round_info))
            elif isinstance(item, DoneEvent):
                result = item.result
                call = _call_of(job, result)
                if call is not None:
                    yield _chunk(job, model, Delta(tool_calls=_calls(call, 0)))
                elif held:
                    yield _chunk(job, model, Delta(content="".join(held)), logprobs=ChoiceLogprobs(
                        content=chat_logprobs(result.logprobs(), job.top_logprobs)) if job.logprobs else None)
                yield _chunk(job, model, Delta(), finish_reason_of(result, call),
                             result_info(result, started, detailed))
                if include_usage:
                    usage = ChatCompletionChunk(id=job.id, created=int(job.created), model=model, choices=[],
                                                usage=usage_of(result, started))
                    yield sse(usage.model_dump(mode="json", exclude={"specfuse"}))
            elif (frame := failure_frame(item, detailed)) is not None:
                yield frame
        yield sse("[DONE]")
    finally:
        cancel()  # a no-op when the job already ended


__all__ = [
    "APIError",
    "api_error",
    "complete",
    "completion_body",
    "failure_frame",
    "finished",
    "result_info",
    "sse",
    "stream",
    "usage_of",
]
