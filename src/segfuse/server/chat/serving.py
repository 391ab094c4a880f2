"""``POST /v1/chat/completions``: a request's chat job, answered as a chat completion or as its chunks.

Streaming and non-streaming read the same item iterator (``Job.items``), so the
two can only differ in framing. The Messages and Responses APIs plan the same
chat job (``planning.plan_of``) and answer it in their own shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...logprobs import TokenLogprob, answer_logprobs
from ...tools import ToolCall
from ...types import Result, RoundEvent, Segment, SegmentEvent
from ..answer import Answer
from ..loading import streamed
from ..models.pool import Lease
from ..serving import disconnected, finish_reason_of, segment_info, sse
from ..state import ServerState, job_for, require_members, submit, using
from ..wire import FusionInfo, RoundInfo
from ..worker.jobs import Job
from . import planning
from .planning import ChatPlan
from .protocol import (
    PATH,
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


def job_of(plan: ChatPlan, lease: Lease, **fields: Any) -> Job:
    """The worker's job for a planned chat request, answered by the lease's members (`fields`: more Job
    fields, e.g. its id)."""
    return job_for(plan.fusion, lease, tools=plan.tools, logprobs=plan.logprobs, **fields)


async def answer(state: ServerState, request: Request) -> Response:
    """A chat completion: the request's body planned, its job queued, the answer whole or streamed.

    The body is parsed by hand (``planning.plan_chat``) to tell bad JSON (400) from a bad shape (422).
    """
    body = await state.body(request)
    plan = await state.offload(planning.plan_chat, body, state.defaults, state.config.limits)
    detailed = state.holds_key(request)
    require_members(state, detailed)
    model = plan.request.model or state.model_id

    async def start(lease: Lease) -> tuple[Answer, Callable[[], None]]:
        job = job_of(plan, lease, streamed=plan.request.stream)
        cancel = submit(state, [job], lease, detailed, plan.request.user)
        return ChatAnswer(job, model, detailed, plan.request.include_usage), cancel

    if plan.request.stream:
        return await streamed(state, model, plan.request.keep_alive, start, ChatAnswer)
    async with using(state, model, plan.request.keep_alive) as lease:
        reply, _ = await start(lease)
    return JSONResponse(await reply.whole(disconnected(request), state.queue.cancel))


def _calls(call: ToolCall, index: int | None = None) -> list[dict[str, Any]]:
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return [entry if index is None else {"index": index, **entry}]


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


class ChatAnswer(Answer):
    """A chat completion, or its chunks: role chunk, one delta per segment, finish, [usage], [DONE].

    A round's segment is sent with its round record, which follows at once; a leader's pieces as it
    writes them (partial segments) go out alone at once, and their round's record then comes with the
    round's last piece, or alone in a chunk with no content. A failure after the stream began is sent as
    an ``error`` event; ``[DONE]`` always ends the stream.
    """

    PATHS = (PATH,)

    def __init__(self, job: Job, model: str, detailed: bool = False, include_usage: bool = False) -> None:
        super().__init__(job, model, detailed)
        self.include_usage = include_usage  # a last chunk with the usage (stream_options.include_usage)
        self.pending: Segment | None = None  # a round's segment, sent with its round record

    # ----------------------------------------------------------------------- the whole answer

    def body(self, result: Result) -> dict[str, Any]:
        completion = ChatCompletion(
            **self.envelope(),
            choices=[self._choice(result)],
            usage=self.usage(result),
            segfuse=self.full_info(result),
        )
        return completion.model_dump(mode="json")

    def _choice(self, result: Result) -> Choice:
        call = self.call(result)
        message = (
            AssistantMessage(content=None, tool_calls=_calls(call)) if call else AssistantMessage(content=result.text)
        )
        logprobs = None
        if self.job.logprobs:
            logprobs = ChoiceLogprobs(content=None if call else self._logprobs(result.logprobs()))
        return Choice(message=message, finish_reason=finish_reason_of(result, call), logprobs=logprobs)

    def _logprobs(self, tokens: list[TokenLogprob]) -> list[TokenLogprobInfo]:
        return chat_logprobs(tokens, self.job.fusion.top_logprobs)

    # ----------------------------------------------------------------------- the answer as it is written

    def _chunk(
        self,
        delta: Delta,
        finish: str | None = None,
        info: FusionInfo | None = None,
        logprobs: ChoiceLogprobs | None = None,
    ) -> str:
        chunk = ChatCompletionChunk(
            **self.envelope(),
            choices=[ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)],
            segfuse=info,
        )
        return sse(chunk.model_dump(mode="json", exclude={"usage"}))

    def _segment_chunk(self, segment: Segment, round_info: RoundInfo | None = None) -> str:
        logprobs = ChoiceLogprobs(content=self._logprobs(answer_logprobs([segment]))) if self.job.logprobs else None
        info = FusionInfo(segment=segment_info(segment), round=round_info)
        return self._chunk(Delta(content=segment.text), info=info, logprobs=logprobs)

    def _flush(self, round_info: RoundInfo | None = None) -> list[str]:
        """The pending segment's chunk (with its round's record, when it came), if one is pending."""
        if self.pending is None:
            return []
        segment, self.pending = self.pending, None
        return [self._segment_chunk(segment, round_info)]

    def opening(self) -> list[str]:
        return [self._chunk(Delta(role="assistant", content=""), info=FusionInfo())]

    def on_start(self) -> list[str]:
        assert self.started is not None
        return [self._chunk(Delta(), info=FusionInfo(prompt_tokens=self.started.prompt_tokens))]

    def segment(self, event: SegmentEvent) -> list[str]:
        frames = self._flush()
        if event.partial:  # the leader's words as it writes them: out at once
            return [*frames, self._segment_chunk(event.segment)]
        self.pending = event.segment  # sent with its round record, which comes next
        return frames

    def round(self, event: RoundEvent) -> list[str]:
        round_info = RoundInfo.model_validate(event.record.to_dict())
        # a round whose winner was "stop here" has no text: still worth showing
        return self._flush(round_info) or [self._chunk(Delta(), info=FusionInfo(round=round_info))]

    def done(self, result: Result) -> list[str]:
        """The frames after the answer: a held answer (a call, or text), the finish, [usage]."""
        frames = self._flush()
        call = self.call(result)
        if call is not None:
            frames.append(self._chunk(Delta(tool_calls=_calls(call, 0))))
        elif self.held:
            logprobs = ChoiceLogprobs(content=self._logprobs(result.logprobs())) if self.job.logprobs else None
            frames.append(self._chunk(Delta(content="".join(self.held)), logprobs=logprobs))
        frames.append(self._chunk(Delta(), finish_reason_of(result, call), self.info(result)))
        if self.include_usage:
            usage = ChatCompletionChunk(**self.envelope(), choices=[], usage=self.usage(result))
            frames.append(sse(usage.model_dump(mode="json", exclude={"segfuse"})))
        return frames


__all__ = ["ChatAnswer", "answer", "chat_logprobs", "job_of"]
