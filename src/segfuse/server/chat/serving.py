"""``POST /v1/chat/completions``: a request's chat job, answered as a chat completion or as its chunks.

Streaming and non-streaming read the same item iterator (``Job.items``), so the
two can only differ in framing. The Messages and Responses APIs plan the same
chat job (``planning.plan_of``) and answer it in their own shapes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...logprobs import TokenLogprob, answer_logprobs
from ...tools import ToolCall
from ...types import DoneEvent, Result, RoundEvent, Segment, SegmentEvent
from ..serving import (
    KEEPALIVE_FRAME,
    KEEPALIVE_S,
    call_of,
    disconnected,
    event_stream,
    failure_frame,
    finish_reason_of,
    finished,
    full_info,
    result_info,
    segment_info,
    sse,
    usage_of,
)
from ..state import ServerState, job_for, members_for, require_members, submit
from ..wire import FusionInfo, RoundInfo
from ..worker import Job, Started
from . import planning
from .planning import ChatPlan
from .protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    TokenLogprobInfo,
    TopLogprob,
)


def job_of(state: ServerState, plan: ChatPlan, model: str, **fields: Any) -> Job:
    """The worker's job for a planned chat request (`fields`: more Job fields, e.g. its id)."""
    return job_for(
        state, plan.generation, members_for(state, model), tools=plan.tools, logprobs=plan.logprobs, **fields
    )


async def answer(state: ServerState, request: Request) -> Response:
    """A chat completion: the request's body planned, its job queued, the answer whole or streamed.

    The body is parsed by hand (``planning.plan_chat``) to tell bad JSON (400) from a bad shape (422).
    """
    body = await state.body(request)
    plan = await state.offload(planning.plan_chat, body, state.defaults, state.config.limits)
    detailed = state.holds_key(request)
    require_members(state, detailed)
    model = plan.request.model or state.model_id
    job = job_of(state, plan, model, streamed=plan.request.stream)
    cancel = submit(state, [job], detailed, plan.request.user)
    if plan.request.stream:
        return event_stream(stream(job, model, plan.request.include_usage, cancel, detailed), cancel)
    result = await complete(job, model, disconnected(request), cancel, detailed)
    return JSONResponse(result.model_dump(mode="json"))


# --------------------------------------------------------------------------- the whole answer


def _calls(call: ToolCall, index: int | None = None) -> list[dict[str, Any]]:
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return [entry if index is None else {"index": index, **entry}]


def completion_body(
    job: Job, model: str, result: Result, started: Started | None, detailed: bool = False
) -> ChatCompletion:
    return ChatCompletion(
        id=job.id,
        created=int(job.created),
        model=model,
        choices=[_choice(job, result)],
        usage=usage_of(result, started),
        segfuse=full_info(result, started, detailed),
    )


def _choice(job: Job, result: Result) -> Choice:
    call = call_of(job, result)
    message = AssistantMessage(content=None, tool_calls=_calls(call)) if call else AssistantMessage(content=result.text)
    logprobs = None
    if job.logprobs:
        logprobs = ChoiceLogprobs(content=None if call else chat_logprobs(result.logprobs(), job.request.top_logprobs))
    return Choice(message=message, finish_reason=finish_reason_of(result, call), logprobs=logprobs)


def chat_logprobs(tokens: list[TokenLogprob], k: int) -> list[TokenLogprobInfo]:
    """Answer tokens in the chat shape: text, log-probability, bytes, the author's top `k`, who wrote it."""
    return [
        TokenLogprobInfo(
            token=t.text,
            logprob=t.logprob,
            bytes=list(t.bytes),
            model=t.model,
            top_logprobs=[TopLogprob(token=text, logprob=lp, bytes=list(data)) for text, data, lp in t.top[:k]],
        )
        for t in tokens
    ]


async def complete(
    job: Job, model: str, disconnected: Callable[[], Any], cancel: Callable[[], None], detailed: bool = False
) -> ChatCompletion:
    """The chat completion of the whole answer (see ``serving.finished``)."""
    result, started = await finished(job, disconnected, cancel, detailed)
    return completion_body(job, model, result, started, detailed)


# --------------------------------------------------------------------------- the answer as it is written


def _chunk(
    job: Job,
    model: str,
    delta: Delta,
    finish: str | None = None,
    info: FusionInfo | None = None,
    logprobs: ChoiceLogprobs | None = None,
) -> str:
    chunk = ChatCompletionChunk(
        id=job.id,
        created=int(job.created),
        model=model,
        choices=[ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)],
        segfuse=info,
    )
    return sse(chunk.model_dump(mode="json", exclude={"usage"}))


def _segment_chunk(job: Job, model: str, segment: Segment, round_info: RoundInfo | None = None) -> str:
    logprobs = (
        ChoiceLogprobs(content=chat_logprobs(answer_logprobs([segment]), job.request.top_logprobs))
        if job.logprobs
        else None
    )
    return _chunk(
        job,
        model,
        Delta(content=segment.text),
        info=FusionInfo(segment=segment_info(segment), round=round_info),
        logprobs=logprobs,
    )


def _closing(
    job: Job, model: str, result: Result, started: Started | None, held: list[str], include_usage: bool, detailed: bool
) -> list[str]:
    """The frames after the answer: a held answer (a call, or text), the finish, [usage]."""
    frames = []
    call = call_of(job, result)
    if call is not None:
        frames.append(_chunk(job, model, Delta(tool_calls=_calls(call, 0))))
    elif held:
        frames.append(
            _chunk(
                job,
                model,
                Delta(content="".join(held)),
                logprobs=ChoiceLogprobs(content=chat_logprobs(result.logprobs(), job.request.top_logprobs))
                if job.logprobs
                else None,
            )
        )
    frames.append(_chunk(job, model, Delta(), finish_reason_of(result, call), result_info(result, started, detailed)))
    if include_usage:
        usage = ChatCompletionChunk(
            id=job.id, created=int(job.created), model=model, choices=[], usage=usage_of(result, started)
        )
        frames.append(sse(usage.model_dump(mode="json", exclude={"segfuse"})))
    return frames


async def stream(
    job: Job, model: str, include_usage: bool, cancel: Callable[[], None], detailed: bool = False
) -> AsyncIterator[str]:
    """SSE frames: role chunk, one delta per segment, finish, [usage], [DONE].

    A round's segment is sent with its round record, which follows at once; a leader's pieces as it
    writes them (partial segments) go out alone at once, and their round's record then comes with the
    round's last piece, or alone in a chunk with no content. A failure after the stream began is sent as
    an ``error`` event; ``[DONE]`` always ends the stream. If the client disconnects, the server cancels
    this generator at its current await and ``finally`` cancels the job.
    """
    yield _chunk(job, model, Delta(role="assistant", content=""), info=FusionInfo())
    started: Started | None = None
    pending: Segment | None = None
    held: list[str] = []  # with tools offered: the answer's text until it is known to be a call or not
    try:
        async for item in job.items(keepalive_s=KEEPALIVE_S):
            if item is None:
                yield KEEPALIVE_FRAME
            elif isinstance(item, Started):
                started = item
                yield _chunk(job, model, Delta(), info=FusionInfo(prompt_tokens=item.prompt_tokens))
            elif isinstance(item, SegmentEvent):
                if job.tools:  # the answer may be a call: its text is sent at the end, as a call or as text
                    held.append(item.segment.text)
                    continue
                if pending is not None:
                    yield _segment_chunk(job, model, pending)
                    pending = None
                if item.partial:  # the leader's words as it writes them: out at once
                    yield _segment_chunk(job, model, item.segment)
                else:
                    pending = item.segment  # sent with its round record, which comes next
            elif isinstance(item, RoundEvent):
                round_info = RoundInfo.model_validate(item.record.to_dict())
                if pending is not None:
                    yield _segment_chunk(job, model, pending, round_info)
                    pending = None
                else:  # a round whose winner was "stop here": no text, still worth showing
                    yield _chunk(job, model, Delta(), info=FusionInfo(round=round_info))
            elif isinstance(item, DoneEvent):
                if pending is not None:
                    yield _segment_chunk(job, model, pending)
                for frame in _closing(job, model, item.result, started, held, include_usage, detailed):
                    yield frame
            elif (failed := failure_frame(item, detailed)) is not None:
                yield failed
        yield sse("[DONE]")
    finally:
        cancel()  # a no-op when the job already ended


__all__ = ["answer", "chat_logprobs", "complete", "completion_body", "job_of", "stream"]
