"""An answer on its way out: one object per request, as the parsed request is one object on the way in.

An :class:`Answer` holds what every part of a response needs (the job, the model id it answers as,
whether internal texts may show: ``detailed``, the job's ``Started``, the text held back while it may
be a tool call) and writes the answer whole (:meth:`Answer.whole`) or as server-sent events
(:meth:`Answer.stream`). The stream's loop over the job's items is written here once; each API's
subclass (``chat``, ``completions``, ``messages``, ``responses``) says what each item becomes (its
hooks: ``opening``, ``keepalive``, ``on_start``, ``segment``, ``round``, ``done``) and how a stream
ends on an error (``error_ending``, a class method: the Ray proxy asks it for a stream whose replica
died, by the paths the class serves).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, ClassVar

from fastapi.responses import StreamingResponse

from ..types import DoneEvent, Result, RoundEvent, SegmentEvent
from .serving import KEEPALIVE_FRAME, KEEPALIVE_S, APIError, event_stream, failure_of, finished, sse
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
