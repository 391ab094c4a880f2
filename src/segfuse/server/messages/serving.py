"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over the chat job.

The request is translated to the chat request it means (``protocol.to_chat``) and planned as chat plans
it, so tools, structured output, limits and fusion options behave the same; the answer is written back as
a Message, or as Anthropic's stream of events. Errors on these paths are in Anthropic's shape
(``protocol.error_body``), the key may come as ``x-api-key``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...backends.base import Member
from ...config import LimitsSection
from ...options import FusionOptions
from ...types import Message, Result, SegmentEvent
from .. import limits as checks
from .. import parsing
from ..answer import Answer
from ..chat.planning import ChatPlan, plan_of
from ..chat.serving import job_of
from ..loading import streamed
from ..models.pool import Lease
from ..parsing import Defaults, Endpoint
from ..serving import APIError, disconnected, sse
from ..state import ServerState, require_members, submit, using
from ..worker.jobs import Job, prompt_tokens
from .protocol import (
    MESSAGES_NEUTRAL,
    MESSAGES_PARAMETERS,
    PATH,
    AnthropicResponse,
    CountTokensRequest,
    MessagesRequest,
    MessagesUsage,
    error_body,
    to_chat,
)


def check_messages(request: MessagesRequest, limits: LimitsSection) -> None:
    """The budget and stop strings under their Anthropic names (the rest is checked as chat)."""
    checks.check_budget(request.max_tokens, "max_tokens", limits)
    checks.check_stops(request.stop_sequences, "stop_sequences", limits)


MESSAGES = Endpoint(MessagesRequest, MESSAGES_PARAMETERS, MESSAGES_NEUTRAL, check_messages)
COUNT_TOKENS = Endpoint(CountTokensRequest, MESSAGES_PARAMETERS, MESSAGES_NEUTRAL, check_messages)


def plan_messages(
    body: bytes, defaults: FusionOptions | Defaults, limits: LimitsSection, endpoint: Endpoint = MESSAGES
) -> tuple[MessagesRequest, ChatPlan]:
    """Body bytes -> the request and the chat plan it means (CPU work: run off the event loop)."""
    try:
        request = parsing.parse_request(body, endpoint, limits)
    except APIError as exc:  # Anthropic answers a bad shape with 400, as any invalid request
        exc.status = 400 if exc.status == 422 else exc.status
        raise
    chat = to_chat(request)
    checks.check_chat(chat, limits)
    return request, plan_of(chat, defaults, limits)


async def answer(state: ServerState, request: Request) -> Response:
    """``/v1/messages``: a Message, or its stream of events."""
    body = await state.body(request)
    parsed, plan = await state.offload(plan_messages, body, state.defaults, state.config.limits)
    detailed = state.holds_key(request)
    require_members(state, detailed)
    model = parsed.model or state.model_id

    async def start(lease: Lease) -> tuple[Answer, Callable[[], None]]:
        job = job_of(plan, lease, id=f"msg_{uuid.uuid4().hex}", streamed=parsed.stream)
        cancel = submit(state, [job], lease, detailed, plan.request.user)
        return MessagesAnswer(job, model, detailed), cancel

    if parsed.stream:
        return await streamed(state, model, parsed.keep_alive, start, MessagesAnswer)
    async with using(state, model, parsed.keep_alive) as lease:
        reply, _ = await start(lease)
    return JSONResponse(await reply.whole(disconnected(request), state.queue.cancel))


async def count_tokens(state: ServerState, request: Request) -> JSONResponse:
    """``/v1/messages/count_tokens``: the prompt's tokens, as the answer's usage would count them."""
    body = await state.body(request)
    parsed, plan = await state.offload(plan_messages, body, state.defaults, state.config.limits, COUNT_TOKENS)
    require_members(state, state.holds_key(request))
    async with using(state, parsed.model or state.model_id, parsed.keep_alive) as lease:
        counted = await state.offload(_count, state.members_of(lease), plan.fusion.messages)
    return JSONResponse({"input_tokens": counted})


def _count(members: Sequence[Member], messages: Sequence[Message]) -> int:
    """The templated prompt's tokens: the longest among the members that would answer (as usage counts)."""
    return max(prompt_tokens(members, messages).values(), default=0)


# --------------------------------------------------------------------------- the answer


def _event(kind: str, **fields: Any) -> str:
    return sse({"type": kind, **fields}, event=kind)


class MessagesAnswer(Answer):
    """A Message, or Anthropic's events: message_start (when the worker takes the job), one text block
    whose deltas are the segments as they come, message_delta (stop reason, usage), message_stop; ping
    while waiting; an ``error`` event ends a stream whose job failed (no ``[DONE]``). With tools, the
    answer is held to its end (a call or text)."""

    PATHS = (PATH, f"{PATH}/count_tokens")
    LAST = ()

    def __init__(self, job: Job, model: str, detailed: bool = False) -> None:
        super().__init__(job, model, detailed)
        self.opened = False  # the text block has started

    def envelope(self) -> dict[str, Any]:
        """A Message's naming fields, as both the Message and ``message_start``'s begin: id, type, role,
        model (no time)."""
        return {"id": self.job.id, "type": "message", "role": "assistant", "model": self.model}

    def body(self, result: Result) -> dict[str, Any]:
        message = AnthropicResponse(
            **self.envelope(),
            content=self.content(result),
            stop_reason=self.stop_reason(result),
            usage=self.messages_usage(result),
            segfuse=self.full_info(result),
        )
        return message.model_dump(mode="json")

    def content(self, result: Result) -> list[dict[str, Any]]:
        """The answer's content blocks: one tool_use, or one text block (none for an empty answer)."""
        call = self.call(result)
        if call is not None:
            return [{"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}]
        return [{"type": "text", "text": result.text}] if result.text else []

    def stop_reason(self, result: Result) -> str:
        """Anthropic's stop reason. The engine does not tell a stop sequence from the end of the turn:
        both are "end_turn"."""
        if self.call(result) is not None:
            return "tool_use"
        return "end_turn" if result.stats.finish_reason == "stop" else "max_tokens"

    def messages_usage(self, result: Result) -> MessagesUsage:
        """The usage (``usage``) under Anthropic's names."""
        usage = self.usage(result)
        return MessagesUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens)

    @classmethod
    def error_ending(cls, error: APIError, sequence: int = 0) -> list[str]:
        return [sse(error_body(error), event="error")]

    def keepalive(self) -> list[str]:
        return [_event("ping")]

    @classmethod
    def loading(cls, members: list[str]) -> list[str]:
        """Anthropic's clients wait on ``ping`` (the comment before it says what loads, for people)."""
        return [*super().loading(members), _event("ping")]

    def on_start(self) -> list[str]:
        started = self.started
        prompt = max(started.prompt_tokens.values(), default=0) if started else 0
        message: dict[str, Any] = {
            **self.envelope(),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": 0},
        }
        return [_event("message_start", message=message)]

    def segment(self, event: SegmentEvent) -> list[str]:
        frames = []
        if not self.opened:
            self.opened = True
            frames.append(_event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
        frames.append(_event("content_block_delta", index=0, delta={"type": "text_delta", "text": event.segment.text}))
        return frames

    def done(self, result: Result) -> list[str]:
        frames = [_event("content_block_stop", index=0)] if self.opened else self._held_blocks(result, 0)
        usage = self.messages_usage(result)
        return [
            *frames,
            _event(
                "message_delta",
                delta={"stop_reason": self.stop_reason(result), "stop_sequence": None},
                usage={"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens},
                segfuse=self.info(result).model_dump(mode="json"),
            ),
            _event("message_stop"),
        ]

    def _held_blocks(self, result: Result, index: int) -> list[str]:
        """With tools offered, the answer at its end: one tool_use block, or the text held back."""
        call = self.call(result)
        if call is not None:
            return [
                _event(
                    "content_block_start",
                    index=index,
                    content_block={"type": "tool_use", "id": call.id, "name": call.name, "input": {}},
                ),
                _event(
                    "content_block_delta",
                    index=index,
                    delta={"type": "input_json_delta", "partial_json": call.arguments},
                ),
                _event("content_block_stop", index=index),
            ]
        text = "".join(self.held)
        if not text:
            return []
        return [
            _event("content_block_start", index=index, content_block={"type": "text", "text": ""}),
            _event("content_block_delta", index=index, delta={"type": "text_delta", "text": text}),
            _event("content_block_stop", index=index),
        ]


__all__ = ["COUNT_TOKENS", "MESSAGES", "MessagesAnswer", "answer", "count_tokens", "plan_messages"]
