"""``POST /api/chat`` and ``/api/generate``: Ollama's answers, one JSON object or NDJSON lines, over the jobs
every API shares.

A request is planned (``planning``) into the same job a chat completion or a text completion queues; the
answer goes out as Ollama writes it: one line per segment as it is written (``done`` false), then a last
line with ``done_reason`` and the counts and durations in nanoseconds, or all of it as one object with
``stream: false``. Who wrote each segment rides along in ``segfuse``, which Ollama's clients skip. An empty
request loads the model (``done_reason`` "load") or, with ``keep_alive`` 0, unloads it ("unload").
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ...errors import InvalidRequestError, SegfuseError
from ...keep_alive import keep_alive_seconds
from ...tools import ToolCall
from ...types import Result, SegmentEvent
from ..answer import Answer
from ..serving import APIError, api_error, disconnected, segment_info
from ..state import ServerState, job_for, require_members, submit, using
from ..worker.jobs import Job
from . import planning
from .cards import rfc3339
from .planning import OllamaPlan
from .protocol import CHAT_PATH, GENERATE_PATH, error_body

NDJSON = "application/x-ndjson"
NS = 1_000_000_000


def line(payload: dict[str, Any]) -> str:
    """One NDJSON line."""
    return json.dumps(payload, ensure_ascii=False) + "\n"


def _ns(seconds: float | None) -> int:
    return max(0, round((seconds or 0.0) * NS))


def calls_of(call: ToolCall) -> list[dict[str, Any]]:
    """A tool call as Ollama writes one: its arguments an object, not JSON text."""
    function = {"index": 0, "name": call.name, "arguments": json.loads(call.arguments)}
    return [{"id": call.id, "function": function}]


class OllamaAnswer(Answer):
    """An answer in Ollama's shape; its subclass says where the text goes (``message`` or ``response``).
    A stream is NDJSON: no heartbeat (a blank line is no JSON for Ollama's clients), no ``[DONE]``; a
    failure after it began is a last ``{"error": ...}`` line."""

    LAST = ()

    def __init__(self, job: Job, model: str, detailed: bool = False, load_s: float = 0.0) -> None:
        super().__init__(job, model, detailed)
        self.load_s = load_s  # the wait for the model's members to load

    def response(self, cancel: Callable[[], None]) -> StreamingResponse:
        # As the event streams: no cache, and no proxy buffering (each line goes out as it is written).
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            self.stream(cancel), media_type=NDJSON, headers=headers, background=BackgroundTask(cancel)
        )

    @classmethod
    def error_ending(cls, error: APIError, sequence: int = 0) -> list[str]:
        return [line(error_body(error))]

    def keepalive(self) -> list[str]:
        return []

    @classmethod
    def text(cls, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Where a piece of the answer goes."""
        raise NotImplementedError

    @classmethod
    def empty(cls, model: str, reason: str) -> dict[str, Any]:
        """The answer to an empty request, which loaded (`reason` "load") or unloaded the model."""
        return {"model": model, "created_at": rfc3339(time.time()), **cls.text(""), "done": True, "done_reason": reason}

    def head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": rfc3339(time.time())}

    def ending(self, result: Result) -> dict[str, Any]:
        """The last line's fields: why it stopped, the prompt's and the answer's tokens and times."""
        usage, stats = self.usage(result), result.stats
        first = stats.time_to_first_segment_s or 0.0
        return {
            "done": True,
            "done_reason": "stop" if stats.finish_reason == "stop" else "length",
            "total_duration": _ns(time.monotonic() - self.job.accepted_at),
            "load_duration": _ns(self.load_s),
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": _ns(first),  # reading the prompt and the first round
            "eval_count": usage.completion_tokens,
            "eval_duration": _ns(max(0.0, stats.total_s - first)),
        }

    def body(self, result: Result) -> dict[str, Any]:
        call = self.call(result)
        piece = self.text("" if call else result.text, calls_of(call) if call else None)
        return {
            **self.head(),
            **piece,
            **self.ending(result),
            "segfuse": self.full_info(result).model_dump(mode="json"),
        }

    def segment(self, event: SegmentEvent) -> list[str]:
        info = {"segment": segment_info(event.segment).model_dump()}
        return [line({**self.head(), **self.text(event.segment.text), "done": False, "segfuse": info})]

    def done(self, result: Result) -> list[str]:
        """A held answer (a call, or the text held while it might have been one), then the last line."""
        frames, call = [], self.call(result)
        if call is not None:
            frames.append(line({**self.head(), **self.text("", calls_of(call)), "done": False}))
        elif self.held:
            frames.append(line({**self.head(), **self.text("".join(self.held)), "done": False}))
        last = {**self.head(), **self.text(""), **self.ending(result)}
        return [*frames, line({**last, "segfuse": self.info(result).model_dump(mode="json")})]


class ChatLines(OllamaAnswer):
    """``/api/chat``: the answer in ``message``."""

    PATHS = (CHAT_PATH,)

    @classmethod
    def text(cls, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        return {"message": message | {"tool_calls": calls}} if calls else {"message": message}


class GenerateLines(OllamaAnswer):
    """``/api/generate``: the answer in ``response`` (no ``context``: no member's tokens are everyone's)."""

    PATHS = (GENERATE_PATH,)

    @classmethod
    def text(cls, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"response": text}


async def chat(state: ServerState, request: Request) -> Response:
    return await _answer(state, request, planning.plan_chat, ChatLines)


async def generate(state: ServerState, request: Request) -> Response:
    return await _answer(state, request, planning.plan_generate, GenerateLines)


async def _answer(
    state: ServerState, request: Request, plan_with: Callable[..., OllamaPlan], kind: type[OllamaAnswer]
) -> Response:
    body = await state.body(request)
    plan: OllamaPlan = await state.offload(plan_with, body, state.defaults, state.config.limits)
    detailed = state.holds_key(request)
    require_members(state, detailed)
    model = plan.model or state.model_id
    named = plan.request.model or model  # Ollama answers with the name the client gave
    if plan.fusion is None:
        reason = await _load_or_unload(state, model, plan.request.keep_alive)
        return JSONResponse(kind.empty(named, reason))
    began = time.monotonic()
    async with using(state, model, plan.request.keep_alive) as lease:
        loaded = time.monotonic()
        job = job_for(plan.fusion, lease, tools=plan.tools, streamed=plan.request.stream, id=uuid.uuid4().hex)
        cancel = submit(state, [job], lease, detailed)
    reply = kind(job, named, detailed, loaded - began)
    if plan.request.stream:
        return reply.response(cancel)
    return JSONResponse(await reply.whole(disconnected(request), state.queue.cancel))


async def _load_or_unload(state: ServerState, model: str, keep_alive: str | float | None) -> str:
    """An empty request: "unload" (keep_alive 0: the model's idle members are freed now) or "load" (its
    members loaded, then kept for the keep-alive, as after an answer)."""
    try:
        unload = keep_alive is not None and keep_alive_seconds(keep_alive) == 0
        if unload:
            state.pool.expire(state.catalog.model(model))
            return "unload"
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message}; {exc.hint}", code="invalid_value", param="keep_alive") from None
    except SegfuseError as exc:  # an unknown model: the catalog's text names the known ones
        raise api_error(exc, detailed=True) from None
    async with using(state, model, keep_alive):
        return "load"


__all__ = ["ChatLines", "GenerateLines", "OllamaAnswer", "calls_of", "chat", "generate", "line"]
