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
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from ..constraints import Constraint
from ..tools import Tool, ToolCall, call_text, chosen_tools, parse_tools, read_call, render, result_text, tool_constraint
from ..ensemble import to_messages
from ..errors import (
    InvalidRequestError,
    MemberFailedError,
    MemberLoadError,
    SpecFuseError,
    UnknownModelError,
)
from ..logprobs import TokenLogprob, answer_logprobs
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


@dataclass(frozen=True)
class Endpoint:
    """What one endpoint's body may hold: its request type, and which other OpenAI fields pass."""

    request: type[BaseModel]
    supported: tuple[str, ...]
    neutral: dict[str, tuple[Any, ...]]


CHAT = Endpoint(ChatCompletionRequest, SUPPORTED_PARAMETERS, NEUTRAL_PARAMETERS)


def unsupported(data: dict[str, Any], endpoint: Endpoint = CHAT) -> list[str]:
    """The request fields SpecFuse would have to ignore to answer, in body order.

    Supported fields, tolerated ones and OpenAI parameters at a neutral value
    (null included) pass; anything else would change what the client asked for.
    """
    refused = []
    for name, value in data.items():
        if name in endpoint.supported or name in TOLERATED_PARAMETERS:
            continue
        neutral = endpoint.neutral.get(name)
        if neutral is not None and (value is None or any(_same(value, n) for n in neutral)):
            continue
        refused.append(name)
    return refused


def unsupported_error(names: list[str], endpoint: Endpoint = CHAT) -> APIError:
    """400 unsupported_parameter naming the first refused field (and the others in the message)."""
    first = names[0]
    if first in endpoint.neutral:
        neutral = " or ".join([json.dumps(v) for v in endpoint.neutral[first]] + ["null"])
        why = f"unsupported parameter {first!r}: SpecFuse does not implement it (accepted only as {neutral})"
    elif first in FusionOptions.model_fields:
        why = (f"unsupported parameter {first!r}: fusion options go in the 'specfuse' object, "
               f'as {{"specfuse": {{"{first}": ...}}}}')
    else:
        why = f"unsupported parameter {first!r}: SpecFuse does not know it"
    also = f" (also unsupported: {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
    supported = ", ".join(endpoint.supported)
    return APIError(400, f"{why}{also}. Supported parameters: {supported} (see docs/server.md)",
                    code="unsupported_parameter", param=first)


def parse_request(body: bytes, endpoint: Endpoint = CHAT) -> Any:
    """JSON bytes -> a validated request (a ChatCompletionRequest by default).

    400 for bad JSON or a parameter SpecFuse does not implement (``unsupported``),
    422 for a bad shape.
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    refused = unsupported(data, endpoint)
    if refused:
        raise unsupported_error(refused, endpoint)
    try:
        request = endpoint.request.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise APIError(422, f"{where}: {first['msg']}{more}", code="invalid_value", param=where or None) from None
    if request.model_extra:
        log.debug("ignoring fields that do not change the answer: %s", ", ".join(sorted(request.model_extra)))
    return request


def fusion_options(request: Any, defaults: FusionOptions) -> FusionOptions:
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


def top_logprobs(request: ChatCompletionRequest) -> int | None:
    """How many alternatives per answer token the chat request asks for (None: no logprobs)."""
    if request.top_logprobs and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def offered_tools(request: ChatCompletionRequest) -> tuple[list[Tool], str]:
    """``tools`` and ``tool_choice`` -> (the tools offered, "none" | "auto" | "required"); 400 naming the field."""
    try:
        tools = parse_tools(request.tools or [])
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_value", param="tools") from None
    try:
        return chosen_tools(tools, request.tool_choice)
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_value", param="tool_choice") from None


def constraint_of(request: ChatCompletionRequest, tools: list[Tool] | None = None,
                  mode: str = "none") -> Constraint | None:
    """``response_format`` (or the tools offered) -> what the answer must be (None: free text); 400 naming
    the field when it is wrong."""
    spec = request.response_format
    if tools and mode != "none":
        if spec is not None and spec.get("type") != "text":
            raise APIError(400, "response_format and tools together: the answer is either a tool call or the "
                                "format", code="invalid_value", param="response_format")
        return tool_constraint(tools, mode)
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


def to_engine_messages(request: ChatCompletionRequest, tools: list[Tool] | None = None,
                       mode: str = "none") -> list[Message]:
    """The conversation as the members read it: earlier tool calls and results in plain text, the tools
    offered noted in the system message (tools.py)."""
    messages: list[Message] = []
    names: dict[str, str] = {}  # call id -> function name, to say whose result a tool turn is
    for m in request.messages:
        if m.role == "assistant" and m.tool_calls:
            calls = [c.get("function") or {} for c in m.tool_calls]
            names.update({c.get("id", ""): f.get("name", "") for c, f in zip(m.tool_calls, calls)})
            text = "\n".join(call_text(f.get("name", ""), f.get("arguments", "{}")) for f in calls)
            messages.append(Message("assistant", (m.text() + "\n" + text).strip()))
        elif m.role == "tool":
            turn = result_text(names.get(m.tool_call_id or "") or m.name, m.tool_call_id, m.text())
            if messages and messages[-1].role == "user" and messages[-1].content.startswith("Result of "):
                turn = f"{messages.pop().content}\n\n{turn}"  # several results of one turn's calls, together
            messages.append(Message("user", turn))
        else:
            messages.append(Message("system" if m.role == "developer" else m.role, m.text()))
    messages = render(messages, tools or [], mode)
    try:
        return to_messages(messages)
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_messages", param="messages") from None


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


def result_info(result: Result, started: Started | None) -> FusionInfo:
    """The parts of a finished result every response carries (members, stats, weights, departures)."""
    return FusionInfo(
        members=result.models,
        stats=_stats(result, started),
        weights=result.weights or None,
        departures=[asdict(d) for d in result.departures] or None,
    )


def segment_info(segment: Segment) -> SegmentInfo:
    return SegmentInfo(text=segment.text, model=segment.model, round=segment.round)


def completion_body(job: Job, model: str, result: Result, started: Started | None) -> ChatCompletion:
    return ChatCompletion(
        id=job.id,
        created=int(job.created),
        model=model,
        choices=[_choice(job, result)],
        usage=usage_of(result, started),
        specfuse=result_info(result, started).model_copy(update={
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
                   cancel: Callable[[], None]) -> tuple[Result, Started | None]:
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
                raise api_error(item.error)
            elif isinstance(item, Cancelled):
                raise APIError(503, "the generation was cancelled", "server_error", "cancelled")
        raise APIError(500, "the generation ended without a result", "server_error")
    finally:
        watcher.cancel()
        cancel()  # a no-op when the job already ended


async def complete(job: Job, model: str, disconnected: Callable[[], Awaitable[None]],
                   cancel: Callable[[], None]) -> ChatCompletion:
    """The chat completion of the whole answer (see ``finished``)."""
    result, started = await finished(job, disconnected, cancel)
    return completion_body(job, model, result, started)


def failure_frame(item: Any) -> str | None:
    """The SSE error event that ends a stream whose job failed or was cancelled (None for other items)."""
    if isinstance(item, Failed):
        return sse(api_error(item.error).body())
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


async def stream(job: Job, model: str, include_usage: bool, cancel: Callable[[], None]) -> AsyncIterator[str]:
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
                yield _chunk(job, model, Delta(), finish_reason_of(result, call), result_info(result, started))
                if include_usage:
                    usage = ChatCompletionChunk(id=job.id, created=int(job.created), model=model, choices=[],
                                                usage=usage_of(result, started))
                    yield sse(usage.model_dump(mode="json", exclude={"specfuse"}))
            elif (frame := failure_frame(item)) is not None:
                yield frame
        yield sse("[DONE]")
    finally:
        cancel()  # a no-op when the job already ended


__all__ = [
    "APIError",
    "Endpoint",
    "finished",
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
