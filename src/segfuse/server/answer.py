"""An answer on its way out: one object per request, as the parsed request is one object on the way in.

An :class:`Answer` holds what every part of a response needs (the job, the model id it answers as,
whether internal texts may show: ``detailed``, the job's ``Started``, the text held back while it may
be a tool call) and writes the answer whole (:meth:`Answer.whole`) or as server-sent events
(:meth:`Answer.stream`). What every API reports of a finished result is read here, from the answer's own
fields: the fields that name it (:meth:`Answer.envelope`: OpenAI's id, created and model; Messages and
Responses name theirs in their own way), its usage, its ``segfuse`` object (``info``, ``full_info``) and
the tool call it makes (``call``). The stream's loop over the job's items is written here once; each API's
subclass (``chat``, ``completions``, ``messages``, ``responses``) says what each item becomes (its
hooks: ``opening``, ``keepalive``, ``loading``, ``on_start``, ``segment``, ``round``, ``done``) and how a stream
ends on an error (``error_ending``, a class method: the Ray proxy asks it for a stream whose replica
died, by the paths the class serves).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from functools import partial
from typing import Any, ClassVar

from fastapi.responses import StreamingResponse

from ..prompting import prefill_of
from ..tools import ToolCall, read_call
from ..types import DoneEvent, Result, RoundEvent, SegmentEvent
from .guards import redact
from .serving import (
    KEEPALIVE_FRAME,
    KEEPALIVE_S,
    APIError,
    event_stream,
    failure_of,
    finished,
    segment_info,
    sse,
    usage_of,
)
from .wire import FusionInfo, FusionStats, RoundInfo, Usage
from .worker.jobs import Item, Job, Started


class Answer:
    """One job's answer in its API's shape. The base speaks OpenAI's stream ending (an error event,
    then ``[DONE]``); a subclass says what its items become.

    `detailed`: the request holds the API key, so internal texts (a member's fault) keep their paths.
    """

    PATHS: ClassVar[tuple[str, ...]] = ()  # the paths whose streams this class writes ({name}: one segment)
    LAST: ClassVar[tuple[str, ...]] = (sse("[DONE]"),)  # what ends every stream, after its answer or error

    def __init__(self, job: Job, model: str, detailed: bool = False) -> None:
        self.job, self.model, self.detailed = job, model, detailed
        self.started: Started | None = None  # the worker took the job: its queue time and prompt sizes
        self.held: list[str] = []  # with tools offered: the text until it is known to be a call or not

    # ----------------------------------------------------------------------- the whole answer

    async def whole(self, disconnected: Callable[[], Awaitable[None]], stop: Callable[[Job], None]) -> dict[str, Any]:
        """The response body of the whole answer (``serving.finished``: `stop` cancels a job when the
        client hangs up first)."""
        result, self.started = await finished(self.job, disconnected, partial(stop, self.job), self.detailed)
        return self.body(result)

    def body(self, result: Result) -> dict[str, Any]:
        """The response body of the finished `result`, as JSON."""
        raise NotImplementedError

    # ----------------------------------------------------------------------- what every answer reports

    def envelope(self) -> dict[str, Any]:
        """The fields that name this answer, spread into its body and each of its chunks: OpenAI's id,
        created (the job's, in whole seconds) and model. An API that names them otherwise says its own."""
        return {"id": self.job.id, "created": int(self.job.created), "model": self.model}

    def usage(self, result: Result) -> Usage:
        """The finished `result`'s tokens (``serving.usage_of``: the longest prompt, the answer's tokens)."""
        return usage_of(result, self.started)

    def info(self, result: Result) -> FusionInfo:
        """The ``segfuse`` object every answer ends with: members, stats (with the queue time), weights,
        departures (a departure's reason without paths and URLs unless ``detailed``)."""
        departures = [asdict(d) for d in result.departures]
        if not self.detailed:
            departures = [{**d, "reason": redact(str(d.get("reason") or ""))} for d in departures]
        queue_s = round(self.started.queue_s, 3) if self.started else 0.0
        return FusionInfo(
            members=result.models,
            stats=FusionStats(**result.stats.to_dict(), queue_s=queue_s),
            weights=result.weights or None,
            departures=departures or None,
        )

    def full_info(self, result: Result) -> FusionInfo:
        """The ``segfuse`` object of a whole answer: ``info``, with who wrote each segment, every round,
        the prompt sizes."""
        return self.info(result).model_copy(
            update={
                "segments": [segment_info(s) for s in result.segments],
                "rounds": [RoundInfo.model_validate(r.to_dict()) for r in result.rounds],
                "prompt_tokens": self.started.prompt_tokens if self.started else None,
            }
        )

    def call(self, result: Result) -> ToolCall | None:
        """The tool call the finished answer makes (after a prefill, the prefill and the answer), when
        tools were offered."""
        job = self.job
        if not job.tools or result.stats.finish_reason != "stop":
            return None
        return read_call(prefill_of(job.fusion.messages) + result.text, job.tools)

    # ----------------------------------------------------------------------- the answer as it is written

    def response(self, cancel: Callable[[], None]) -> StreamingResponse:
        """The stream as an HTTP response; `cancel` stops the job (also when the client hung up)."""
        return event_stream(self.stream(cancel), cancel)

    async def stream(self, cancel: Callable[[], None]) -> AsyncIterator[str]:
        """The SSE frames: the opening, each item's, then the ending. If the client disconnects, the server
        cancels this generator at its current await and ``finally`` cancels the job."""
        try:
            for frame in self.opening():
                yield frame
            async for item in self.job.items(keepalive_s=KEEPALIVE_S):
                for frame in self.frames(item):
                    yield frame
            for frame in self.LAST:
                yield frame
        finally:
            cancel()  # a no-op when the job already ended

    def frames(self, item: Item | None) -> list[str]:
        """What one item of the job becomes (None: nothing came for a while)."""
        if item is None:
            return self.keepalive()
        if isinstance(item, Started):
            self.started = item
            return self.on_start()
        if isinstance(item, SegmentEvent):
            if self.job.tools:  # the answer may be a call: its text goes out at the end, as a call or text
                self.held.append(item.segment.text)
                return []
            return self.segment(item)
        if isinstance(item, RoundEvent):
            return self.round(item)
        if isinstance(item, DoneEvent):
            return self.done(item.result)
        error = failure_of(item, self.detailed)
        return [] if error is None else self.failure(error)

    # ----------------------------------------------------------------------- the hooks

    def opening(self) -> list[str]:
        """The frames before any item."""
        return []

    def keepalive(self) -> list[str]:
        """A heartbeat while nothing comes (it keeps proxies from closing a queued stream)."""
        return [KEEPALIVE_FRAME]

    def on_start(self) -> list[str]:
        """The worker took the job (``self.started``)."""
        return []

    def segment(self, event: SegmentEvent) -> list[str]:
        """An accepted segment, or a leader's piece as it writes it (``event.partial``)."""
        return []

    def round(self, event: RoundEvent) -> list[str]:
        """A round's record."""
        return []

    def done(self, result: Result) -> list[str]:
        """The answer's end: the frames that close it."""
        return []

    def failure(self, error: APIError) -> list[str]:
        """The job failed or was cancelled after the stream began."""
        return self.error_ending(error)

    # ----------------------------------------------------------------------- by class: loading, errors

    @classmethod
    def loading(cls, members: list[str]) -> list[str]:
        """What a stream waiting for `members` to load says, at once and every few seconds (``loading.py``):
        an SSE comment, which every SSE client skips and the web view shows."""
        return [f": loading {', '.join(members)}\n\n"]

    # ----------------------------------------------------------------------- the error ending, by class

    @classmethod
    def error_ending(cls, error: APIError, sequence: int = 0) -> list[str]:
        """The frames that end this API's stream on `error` (`sequence`: the number its event takes, for
        an API that numbers its events); ``LAST`` follows them."""
        return [sse(error.body())]

    @classmethod
    def cut_ending(cls, error: APIError, last_sequence: int | None) -> str:
        """What ends a stream of this API that was cut off after its event numbered `last_sequence`
        (None: none numbered): the error ending, then ``LAST``."""
        frames = cls.error_ending(error, 0 if last_sequence is None else last_sequence + 1)
        return "".join([*frames, *cls.LAST])

    @classmethod
    def serves(cls, path: str) -> bool:
        """Whether `path` is one of ``PATHS`` (a ``{name}`` in one stands for one path segment)."""
        return any(_matches(template.split("/"), path.split("/")) for template in cls.PATHS)


def _matches(template: list[str], path: list[str]) -> bool:
    """Segment by segment, `path` is `template` (whose ``{name}`` segments take any one)."""
    return len(template) == len(path) and all(
        t == p or (t.startswith("{") and t.endswith("}") and p != "") for t, p in zip(template, path)
    )


__all__ = ["Answer"]
