"""Requests -> jobs, and a job's events -> an OpenAI response body or SSE chunks.

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

from pydantic import ValidationError

from ..constraints import Constraint
from ..ensemble import to_messages
from ..errors import (
    InvalidRequestError,
    MemberFailedError,
    MemberLoadError,
    SpecFuseError,
    UnknownModelError,
)
from ..options import FusionOptions
from ..types import DoneEvent, Message, Result, RoundEvent, Segment, SegmentEvent
from .protocol import (
    NEUTRAL_PARAMETERS,
    SUPPORTED_PARAMETERS,
    TOLERATED_PARAMETERS,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    ErrorDetail,
    ErrorResponse,
    FusionInfo,
    FusionStats,
    RoundInfo,
    SegmentInfo,
    Usage,
)
from .worker import Cancelled, Failed, Job, QueueFullError, ShuttingDownError, Started

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


def api_error(exc: BaseException) -> APIError:
    """Map any exception to the APIError a client should see (no internals for bugs)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SpecFuseError):
        text = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
        if isinstance(exc, QueueFullError):
            return APIError(429, text, "rate_limit_error", "queue_full")
        if isinstance(exc, ShuttingDownError):
            return APIError(503, text, "server_error", "shutting_down")
        if isinstance(exc, UnknownModelError):
            return APIError(404, text, "invalid_request_error", "model_not_found", "model")
        if isinstance(exc, InvalidRequestError):
            return APIError(400, text, "invalid_request_error", "invalid_request")
        if isinstance(exc, MemberFailedError | MemberLoadError):
            return APIError(500, text, "server_error", "member_failed")
        return APIError(500, text, "server_error")
    return APIError(500, "internal error while generating; see the server log", "server_error")


# --------------------------------------------------------------------------- parsing


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (``false`` is not ``0``)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return isinstance(value, bool) and isinstance(neutral, bool) and value == neutral
    if isinstance(neutral, int | float):
        return isinstance(value, int | float) and value == neutral
    if isinstance(neutral, dict):
        return (isinstance(value, dict) and value.keys() == neutral.keys()
                and all(_same(value[k], neutral[k]) for k in neutral))
    if isinstance(neutral, list):
        return isinstance(value, list) and len(value) == len(neutral) and all(map(_same, value, neutral))
    return type(value) is type(neutral) and value == neutral


def unsupported(data: dict[str, Any]) -> list[str]:
    """The request fields SpecFuse would have to ignore to answer, in body order.

    Supported fields, tolerated ones and OpenAI parameters at a neutral value
    (null included) pass; anything else would change what the client asked for.
    """
    refused = []
    for name, value in data.items():
        if name in SUPPORTED_PARAMETERS or name in TOLERATED_PARAMETERS:
            continue
        if name in NEUTRAL_PARAMETERS and (value is None or any(_same(value, n) for n in NEUTRAL_PARAMETERS[name])):
            continue
        refused.append(name)
    return refused


def unsupported_error(names: list[str]) -> APIError:
    """400 unsupported_parameter naming the first refused field (and the others in the message)."""
    first = names[0]
    if first in NEUTRAL_PARAMETERS:
        neutral = " or ".join([json.dumps(v) for v in NEUTRAL_PARAMETERS[first]] + ["null"])
        why = f"unsupported parameter {first!r}: SpecFuse does not implement it (accepted only as {neutral})"
    elif first in FusionOptions.model_fields:
        why = (f"unsupported parameter {first!r}: fusion options go in the 'specfuse' object, "
               f'as {{"specfuse": {{"{first}": ...}}}}')
    else:
        why = f"unsupported parameter {first!r}: SpecFuse does not know it"
    also = f" (also unsupported: {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
    supported = ", ".join(SUPPORTED_PARAMETERS)
    return APIError(400, f"{why}{also}. Supported parameters: {supported} (see docs/server.md)",
                    code="unsupported_parameter", param=first)


def parse_request(body: bytes) -> ChatCompletionRequest:
    """JSON bytes -> a validated request.

    400 for bad JSON or a parameter SpecFuse does not implement (``unsupported``),
    422 for a bad shape.
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    refused = unsupported(data)
    if refused:
        raise unsupported_error(refused)
    try:
        request = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise APIError(422, f"{where}: {first['msg']}{more}", code="invalid_value", param=where or None) from None
    if request.model_extra:
        log.debug("ignoring fields that do not change the answer: %s", ", ".join(sorted(request.model_extra)))
    return request


def fusion_options(request: ChatCompletionRequest, defaults: FusionOptions) -> FusionOptions:
    """The server's defaults with whatever the request sets on top."""
    values: dict[str, Any] = defaults.model_dump()
    asked = {
        "max_tokens": request.answer_budget,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "stop": request.stop,
    }
    values.update({k: v for k, v in asked.items() if v is not None})
    values.update(request.specfuse or {})  # an explicit null is a value here (gate or accept_margin: none)
    try:
        return FusionOptions.build(**values)
    except InvalidRequestError as exc:
        raise APIError(400, exc.message, code="invalid_value") from None


def constraint_of(request: ChatCompletionRequest) -> Constraint | None:
    """``response_format`` -> what the answer must be (None: free text); 400 naming the field when it is wrong."""
    spec = request.response_format
    if spec is None:
        return None
    kind = spec.get("type")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return Constraint.json_object()
        if kind == "json_schema":
            inner = spec.get("json_schema")
            if not isinstance(inner, dict) or "schema" not in inner:
                raise InvalidRequestError("response_format.json_schema must be an object with a 'schema'",
                                          '{"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}')
            return Constraint.json_schema(inner["schema"], inner.get("name"),
                                          where="response_format.json_schema.schema")
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_value", param="response_format") from None
    raise APIError(400, f"response_format.type {kind!r} is not supported: use text, json_object or json_schema",
                   code="invalid_value", param="response_format")


def to_engine_messages(request: ChatCompletionRequest) -> list[Message]:
    messages = [Message("system" if m.role == "developer" else m.role, m.text()) for m in request.messages]
    try:
        return to_messages(messages)
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_messages", param="messages") from None


# --------------------------------------------------------------------------- responses


def _finish_reason(result: Result) -> str:
    return "stop" if result.stats.finish_reason == "stop" else "length"  # "context" is a length limit


def _usage(result: Result, started: Started | None) -> Usage:
    # Members tokenize differently: count the longest prompt, and the winners' answer tokens.
    prompt = max(started.prompt_tokens.values(), default=0) if started else 0
    return Usage(prompt_tokens=prompt, completion_tokens=result.stats.tokens,
                 total_tokens=prompt + result.stats.tokens)


def _stats(result: Result, started: Started | None) -> FusionStats:
    return FusionStats(**result.stats.to_dict(), queue_s=round(started.queue_s, 3) if started else 0.0)


def _result_info(result: Result, started: Started | None) -> FusionInfo:
    """The parts of a finished result every response carries (members, stats, weights, departures)."""
    return FusionInfo(
        members=result.models,
        stats=_stats(result, started),
        weights=result.weights or None,
        departures=[asdict(d) for d in result.departures] or None,
    )


def _segment(segment: Segment) -> SegmentInfo:
    return SegmentInfo(text=segment.text, model=segment.model, round=segment.round)


def completion_body(job: Job, model: str, result: Result, started: Started | None) -> ChatCompletion:
    return ChatCompletion(
        id=job.id,
        created=int(job.created),
        model=model,
        choices=[Choice(message=AssistantMessage(content=result.text), finish_reason=_finish_reason(result))],
        usage=_usage(result, started),
        specfuse=_result_info(result, started).model_copy(update={
            "segments": [_segment(s) for s in result.segments],
            "rounds": [RoundInfo.model_validate(r.to_dict()) for r in result.rounds],
            "prompt_tokens": started.prompt_tokens if started else None,
        }),
    )


async def complete(job: Job, model: str, disconnected: Callable[[], Awaitable[None]],
                   cancel: Callable[[], None]) -> ChatCompletion:
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
                return completion_body(job, model, item.result, started)
            elif isinstance(item, Failed):
                raise api_error(item.error)
            elif isinstance(item, Cancelled):
                raise APIError(503, "the generation was cancelled", "server_error", "cancelled")
        raise APIError(500, "the generation ended without a result", "server_error")
    finally:
        watcher.cancel()
        cancel()  # a no-op when the job already ended


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def _chunk(job: Job, model: str, delta: Delta, finish: str | None = None,
           info: FusionInfo | None = None) -> str:
    chunk = ChatCompletionChunk(id=job.id, created=int(job.created), model=model,
                                choices=[ChunkChoice(delta=delta, finish_reason=finish)], specfuse=info)
    return _sse(chunk.model_dump(mode="json", exclude={"usage"}))


async def stream(job: Job, model: str, include_usage: bool, cancel: Callable[[], None]) -> AsyncIterator[str]:
    """SSE frames: role chunk, one delta per accepted segment, finish, [usage], [DONE].

    A failure after the stream began is sent as an ``error`` event; ``[DONE]``
    always ends the stream. If the client disconnects, the server cancels this
    generator at its current await and ``finally`` cancels the job.
    """
    yield _chunk(job, model, Delta(role="assistant", content=""), info=FusionInfo())
    started: Started | None = None
    pending: Segment | None = None
    try:
        async for item in job.items(keepalive_s=KEEPALIVE_S):
            if item is None:
                yield ": keep-alive\n\n"
            elif isinstance(item, Started):
                started = item
                yield _chunk(job, model, Delta(), info=FusionInfo(prompt_tokens=item.prompt_tokens))
            elif isinstance(item, SegmentEvent):
                pending = item.segment  # sent with its round record, which follows at once
            elif isinstance(item, RoundEvent):
                round_info = RoundInfo.model_validate(item.record.to_dict())
                if pending is not None:
                    yield _chunk(job, model, Delta(content=pending.text),
                                 info=FusionInfo(segment=_segment(pending), round=round_info))
                    pending = None
                else:  # a round whose winner was "stop here": no text, still worth showing
                    yield _chunk(job, model, Delta(), info=FusionInfo(round=round_info))
            elif isinstance(item, DoneEvent):
                result = item.result
                yield _chunk(job, model, Delta(), _finish_reason(result), _result_info(result, started))
                if include_usage:
                    usage = ChatCompletionChunk(id=job.id, created=int(job.created), model=model, choices=[],
                                                usage=_usage(result, started))
                    yield _sse(usage.model_dump(mode="json", exclude={"specfuse"}))
            elif isinstance(item, Failed):
                yield _sse(api_error(item.error).body())
            elif isinstance(item, Cancelled):
                yield _sse(APIError(503, "the generation was cancelled", "server_error", "cancelled").body())
        yield _sse("[DONE]")
    finally:
        cancel()  # a no-op when the job already ended


__all__ = [
    "APIError",
    "api_error",
    "complete",
    "completion_body",
    "fusion_options",
    "parse_request",
    "stream",
    "to_engine_messages",
    "unsupported",
    "unsupported_error",
]
