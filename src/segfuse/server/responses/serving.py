"""``POST /v1/responses``: OpenAI's Responses API over the chat job.

The request becomes the chat request it means (``protocol.to_chat``), continued from a stored response
when it names ``previous_response_id`` (``store``: the newest responses, in memory), and is planned as
chat plans it. The answer is a response object whose output is one message or one
function call, or the Responses stream of events (``response.created`` ... ``response.completed``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...config import LimitsSection
from ...options import FusionOptions
from ...types import Result, SegmentEvent
from .. import limits as checks
from .. import parsing
from ..answer import Answer
from ..chat.planning import ChatPlan, plan_of
from ..chat.serving import job_of
from ..loading import streamed
from ..models.pool import Lease
from ..parsing import Defaults, Endpoint
from ..serving import APIError, disconnected, sse
from ..shared import Responses
from ..state import ServerState, require_members, submit, using
from ..worker.jobs import Job
from .protocol import (
    PATH,
    RESPONSES_NEUTRAL,
    RESPONSES_PARAMETERS,
    ResponsesRequest,
    conversation,
    to_chat,
)


def check_responses(request: ResponsesRequest, limits: LimitsSection) -> None:
    checks.check_budget(request.max_output_tokens, "max_output_tokens", limits)


RESPONSES = Endpoint(ResponsesRequest, RESPONSES_PARAMETERS, RESPONSES_NEUTRAL, check_responses)


@dataclass(frozen=True)
class ResponsesPlan:
    request: ResponsesRequest
    history: list[dict[str, Any]]  # the conversation so far, as chat messages (to store with the answer)
    chat: ChatPlan


def plan_responses(
    body: bytes, defaults: FusionOptions | Defaults, limits: LimitsSection, store: Responses
) -> ResponsesPlan:
    """Body bytes -> the request, its conversation and its chat plan (CPU work: run off the event loop)."""
    request = parsing.parse_request(body, RESPONSES, limits)
    earlier: list[dict[str, Any]] = []
    if request.previous_response_id is not None:
        found = store.get(request.previous_response_id)
        if found is None:
            raise APIError(
                400,
                f"previous response {request.previous_response_id!r} not found: this server "
                "keeps the newest responses made with store on, in memory, until it restarts; send "
                "the whole input instead",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        earlier = found
    chat = to_chat(request, earlier)
    checks.check_chat(chat, limits)
    return ResponsesPlan(request, conversation(request, earlier), plan_of(chat, defaults, limits))


async def answer(state: ServerState, store: Responses, request: Request) -> Response:
    """``/v1/responses``: a response object, or its stream of events (`store`: what previous_response_id
    finds, and where the answer is kept)."""
    body = await state.body(request)
    plan = await state.offload(plan_responses, body, state.defaults, state.config.limits, store)
    detailed = state.holds_key(request)
    require_members(state, detailed)
    model = plan.request.model or state.model_id

    async def start(lease: Lease) -> tuple[Answer, Callable[[], None]]:
        job = job_of(plan.chat, lease, id=f"resp_{uuid.uuid4().hex}", streamed=plan.request.stream)
        cancel = submit(state, [job], lease, detailed, plan.request.user)
        return ResponsesAnswer(job, model, plan, store, detailed), cancel

    if plan.request.stream:
        return await streamed(state, model, plan.request.keep_alive, start, ResponsesAnswer)
    async with using(state, model, plan.request.keep_alive) as lease:
        reply, _ = await start(lease)
    return JSONResponse(await reply.whole(disconnected(request), state.queue.cancel))


class ResponsesAnswer(Answer):
    """One response's wire shapes: its output items, the response object, its stream of events:
    response.created at once, response.in_progress when the worker takes the job, the answer's text as
    output_text deltas as the segments come (with tools: held to the end, a call or text), then the
    closing events and response.completed (response.incomplete at the budget); an ``error`` event ends
    a stream whose job failed. Every event is numbered (``sequence_number``), from 0."""

    PATHS = (PATH,)
    LAST = ()

    def __init__(self, job: Job, model: str, plan: ResponsesPlan, store: Responses, detailed: bool = False) -> None:
        super().__init__(job, model, detailed)
        self.plan, self.store = plan, store
        self.message_id, self.call_item_id = f"msg_{uuid.uuid4().hex}", f"fc_{uuid.uuid4().hex}"
        self.sequence = 0  # the next event's number
        self.opened = False  # the message item is open (its text streams)

    def output(self, result: Result) -> list[dict[str, Any]]:
        call = self.call(result)
        if call is not None:
            return [
                {
                    "type": "function_call",
                    "id": self.call_item_id,
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": call.arguments,
                    "status": "completed",
                }
            ]
        return [self.message(result.text, "completed")]

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def envelope(self) -> dict[str, Any]:
        """The head of every response object: id, object, created_at (the model comes further on, at its
        place in ``snapshot``)."""
        return {"id": self.job.id, "object": "response", "created_at": int(self.job.created)}

    def snapshot(self, status: str, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The response object as it stands (``status``: in_progress, completed, incomplete): every body
        and every event's response is one."""
        r = self.plan.request
        return {
            **self.envelope(),
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": output or [],
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "store": r.store is not False,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "text": r.text or {"format": {"type": "text"}},
            "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [],
            "metadata": r.metadata or {},
            "usage": None,
        }

    def body(self, result: Result) -> dict[str, Any]:
        """The finished response (kept in the store, unless the request said store: false)."""
        output = self.output(result)
        length = result.stats.finish_reason != "stop"
        usage = self.usage(result)
        body = self.snapshot("incomplete" if length else "completed", output)
        body["incomplete_details"] = {"reason": "max_output_tokens"} if length else None
        body["usage"] = {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        }
        body["segfuse"] = self.full_info(result).model_dump(mode="json")
        if self.plan.request.store is not False:
            self.store.put(self.job.id, answered(self.plan.history, _as_chat(output[0])))
        return body

    def event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, event=kind)

    def text_events(self, text: str | None = None) -> list[str]:
        """A message item opened (``text`` None), or opened, written and closed at once."""
        ids = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        frames = [
            self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress")),
            self.event("response.content_part.added", **ids, part=part),
        ]
        if text is not None:
            frames.append(self.event("response.output_text.delta", **ids, delta=text, logprobs=[]))
        return frames

    def closing_text(self, text: str) -> list[str]:
        ids = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return [
            self.event("response.output_text.done", **ids, text=text, logprobs=[]),
            self.event("response.content_part.done", **ids, part=part),
            self.event("response.output_item.done", output_index=0, item=self.message(text, "completed")),
        ]

    def call_events(self, item: dict[str, Any]) -> list[str]:
        ids = {"item_id": item["id"], "output_index": 0}
        return [
            self.event(
                "response.output_item.added", output_index=0, item={**item, "arguments": "", "status": "in_progress"}
            ),
            self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
            self.event("response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=0, item=item),
        ]

    def opening(self) -> list[str]:
        return [self.event("response.created", response=self.snapshot("in_progress"))]

    def on_start(self) -> list[str]:
        return [self.event("response.in_progress", response=self.snapshot("in_progress"))]

    def segment(self, event: SegmentEvent) -> list[str]:
        frames = [] if self.opened else self.text_events()
        self.opened = True
        ids = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        frames.append(self.event("response.output_text.delta", **ids, delta=event.segment.text, logprobs=[]))
        return frames

    def done(self, result: Result) -> list[str]:
        body = self.body(result)
        item = body["output"][0]
        if item["type"] == "function_call":
            frames = self.call_events(item)
        else:
            frames = [] if self.opened else self.text_events("".join(self.held) or None)
            frames += self.closing_text(result.text)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [*frames, self.event(kind, response=body)]

    def failure(self, error: APIError) -> list[str]:
        self.sequence += 1
        return self.error_ending(error, self.sequence - 1)

    @classmethod
    def error_ending(cls, error: APIError, sequence: int = 0) -> list[str]:
        return [error_event(error, sequence)]


def error_event(error: APIError, sequence: int) -> str:
    """The ``error`` event that ends a stream, the `sequence`-th of its stream."""
    detail = error.detail.model_dump()
    return sse(
        {
            "type": "error",
            "sequence_number": sequence,
            "code": detail["code"],
            "message": detail["message"],
            "param": detail["param"],
            "error": detail,
        },
        event="error",
    )


def answered(history: list[dict[str, Any]], turn: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation with the answer's turn. After a prefill (an input that ends with an assistant
    message) the answer continues that message: one turn, the prefill and the answer (a call replaces it:
    the call was written from it)."""
    if not history or history[-1]["role"] != "assistant":
        return [*history, turn]
    if turn.get("tool_calls"):
        return [*history[:-1], turn]
    return [*history[:-1], {"role": "assistant", "content": (history[-1].get("content") or "") + turn["content"]}]


def _as_chat(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the chat message a later request's conversation holds."""
    if item["type"] == "function_call":
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            ],
        }
    return {"role": "assistant", "content": "".join(p["text"] for p in item["content"])}


__all__ = ["RESPONSES", "ResponsesAnswer", "answer", "error_event", "plan_responses"]
