"""A streamed answer whose members must load first: the client hears from the server at once.

Loading a member takes seconds to minutes, and a client (or a proxy) that hears nothing for that long may
give up. So a streaming request whose model is not loaded gets its response at once: a frame that says
what is loading (``Answer.loading``: an SSE comment, ``: loading qwen2.5-coder-0.5b``, which every SSE
client skips; Anthropic's ``ping`` on Messages), again every ``LOADING_S`` while it waits, then the answer
as usual. Whatever fails meanwhile (the load, a full queue) can no longer be an HTTP status: it ends the
stream with the API's error event, as a failure mid-answer does. A request whose members are loaded, or
that is not streamed, is served as before (``using``), errors as statuses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from ..errors import SegfuseError
from .answer import Answer
from .models.pool import Lease
from .serving import APIError, api_error, event_stream
from .state import ServerState, keep_seconds, using

log = logging.getLogger("segfuse.server")
LOADING_S = 2.0  # how often a stream waiting for its members hears that they are still loading

Start = Callable[[Lease], Awaitable[tuple[Answer, Callable[[], None]]]]  # a lease -> the answer, its cancel


async def streamed(
    state: ServerState, model: str, keep_alive: Any, start: Start, kind: type[Answer]
) -> StreamingResponse:
    """A streamed answer of `model`: `start` queues the request's jobs under its lease and returns the answer
    and what cancels it; `kind`: the answer's class, which writes the loading frames and the error ending."""
    try:
        missing = state.pool.missing(state.catalog.model(model))
        keep_seconds(keep_alive)  # a bad keep_alive is a 400 before any stream
    except SegfuseError as exc:
        raise api_error(exc, detailed=True) from None  # names only models the server lists
    if not missing:
        async with using(state, model, keep_alive) as lease:
            reply, cancel = await start(lease)
        return reply.response(cancel)
    waiting = Waiting(state, model, keep_alive, start, kind, missing)
    return event_stream(waiting.events(), waiting.cancel)


class Waiting:
    """One stream that waits for its members: the loading frames, then the answer (or the error ending)."""

    def __init__(
        self, state: ServerState, model: str, keep_alive: Any, start: Start, kind: type[Answer], missing: list[str]
    ) -> None:
        self.state, self.model, self.keep_alive, self.start, self.kind = state, model, keep_alive, start, kind
        self.missing = missing
        self.task: asyncio.Future[tuple[Answer, Callable[[], None]]] | None = None

    async def _leased(self) -> tuple[Answer, Callable[[], None]]:
        async with using(self.state, self.model, self.keep_alive) as lease:
            return await self.start(lease)

    async def events(self) -> AsyncIterator[str]:
        self.task = task = asyncio.ensure_future(self._leased())
        try:
            while True:
                for frame in self.kind.loading(self.missing):
                    yield frame
                await asyncio.wait({task}, timeout=LOADING_S)
                if task.done():
                    break
                self.missing = self.state.pool.missing(self.state.catalog.model(self.model)) or self.missing
            try:
                reply, cancel = task.result()
            except Exception as exc:  # using's and submit's errors are APIErrors already (texts redacted)
                if not isinstance(exc, APIError | SegfuseError):
                    log.exception("a stream waiting for %s failed", self.model)
                for frame in [*self.kind.error_ending(api_error(exc)), *self.kind.LAST]:
                    yield frame
                return
            async for frame in reply.stream(cancel):
                yield frame
        finally:
            self.cancel()

    def cancel(self) -> None:
        """The client went away (or the stream ended): stop waiting, or cancel the jobs queued (a no-op for
        those that ended)."""
        task = self.task
        if task is None:
            return
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            task.result()[1]()


__all__ = ["LOADING_S", "Waiting", "streamed"]
