"""One worker thread runs fused generations one at a time from a bounded queue.

Members keep per-request state in their caches and run on every core, so two
generations at once would only contend; requests wait their turn instead. The
worker hands each event to the request's asyncio queue as it happens and checks
the request's cancel flag after every event, so a cancelled generation stops
within one round (the engine yields at least once per round) and its member
sessions are closed by the generator's ``finally``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

from ..backends.base import Member
from ..engine import fuse
from ..ensemble import Ensemble
from ..errors import InvalidRequestError, SpecFuseError
from ..options import FusionOptions
from ..types import DoneEvent, Event, Message, RoundEvent

log = logging.getLogger("specfuse.server")

# accepted/rejected: at the queue; started: picked up by the worker; then each started job ends
# completed, cancelled, invalid (its input was bad, e.g. a prompt too long) or failed (a fault).
COUNTERS = ("accepted", "rejected", "started", "completed", "cancelled", "invalid", "failed", "rounds")


class QueueFullError(SpecFuseError):
    """Every queue slot is taken; the client should retry later."""


class ShuttingDownError(SpecFuseError):
    """The server is stopping and takes no new work."""


@dataclass(frozen=True)
class Started:
    """The worker picked the job up; how long it waited and the prompt sizes."""

    queue_s: float
    prompt_tokens: dict[str, int]


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class Cancelled:
    pass


Item = Started | Event | Failed | Cancelled


@dataclass(eq=False)
class Job:
    """One request's generation, shared between its HTTP handler and the worker."""

    messages: list[Message]
    options: FusionOptions
    members: list[str] | None = None  # None: the whole ensemble
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: float = field(default_factory=time.time)
    cancel_flag: threading.Event = field(default_factory=threading.Event)
    _loop: asyncio.AbstractEventLoop | None = None
    _items: asyncio.Queue[Item] | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items = asyncio.Queue()

    def emit(self, item: Item) -> None:
        """Thread-safe: hand an item to the waiting handler (dropped if its loop is gone)."""
        assert self._loop is not None and self._items is not None, "job not bound to a loop"
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:
            pass  # the event loop closed: the server is shutting down

    async def items(self, keepalive_s: float | None = None) -> AsyncIterator[Item | None]:
        """Items until a terminal one (DoneEvent, Failed, Cancelled).

        With ``keepalive_s``, yields None whenever nothing arrived for that long,
        so a streaming handler can write a heartbeat.
        """
        assert self._items is not None, "job not bound to a loop"
        while True:
            try:
                item = await asyncio.wait_for(self._items.get(), keepalive_s)
            except TimeoutError:
                yield None
                continue
            yield item
            if isinstance(item, DoneEvent | Failed | Cancelled):
                return


class Worker:
    """The bounded queue and the thread that serves it."""

    def __init__(self, queue_size: int) -> None:
        self.queue_size = queue_size
        self.counters: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._ensemble: Ensemble | None = None
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="specfuse-worker", daemon=True)

    def start(self, ensemble: Ensemble) -> None:
        self._ensemble = ensemble
        self._thread.start()

    def _count(self, name: str) -> None:
        with self._cond:  # the worker thread and the event loop both count
            self.counters[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return dict(self.counters)

    def state(self) -> tuple[int, bool]:
        with self._cond:
            return len(self._waiting), self._running is not None

    def submit(self, job: Job) -> None:
        """Queue a bound job, or raise QueueFullError when every slot is taken."""
        with self._cond:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down", "retry in a moment")
            in_system = len(self._waiting) + (self._running is not None)
            if in_system > self.queue_size:  # one runs, queue_size wait
                self.counters["rejected"] += 1
                raise QueueFullError(
                    f"the request queue is full ({self.queue_size} waiting)", "retry in a little while"
                )
            self._waiting.append(job)
            self.counters["accepted"] += 1
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job: drop it from the queue, or make the worker stop it after this round.

        Safe to call more than once and after the job ended.
        """
        with self._cond:
            if job.cancel_flag.is_set():
                return
            job.cancel_flag.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self.counters["cancelled"] += 1
                log.info("%s cancelled while queued", job.id)
                job.emit(Cancelled())

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and wait for the worker to finish its round."""
        with self._cond:
            self._stopping = True
            jobs = list(self._waiting) + ([self._running] if self._running else [])
        for job in jobs:
            self.cancel(job)
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ worker thread

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._waiting:
                    return
                job = self._waiting.popleft()
                self._running = job
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None

    def _events(self, job: Job) -> tuple[list[Member], Iterator[Event]]:
        assert self._ensemble is not None
        if job.members is None:  # through the Ensemble, which may carry Hedge weights across queries
            return self._ensemble.members, self._ensemble.stream(job.messages, options=job.options)
        members = [m for m in self._ensemble.members if m.name in job.members]
        return members, fuse(members, job.messages, job.options)

    def _run(self, job: Job) -> None:
        self._count("started")
        rounds = 0
        try:
            members, events = self._events(job)
            job.emit(Started(time.time() - job.created, _prompt_tokens(members, job.messages)))
            try:
                for event in events:
                    if isinstance(event, RoundEvent):
                        rounds += 1
                        self._count("rounds")
                    job.emit(event)
                    if job.cancel_flag.is_set() and not isinstance(event, DoneEvent):
                        self._count("cancelled")
                        log.info("%s cancelled after %d rounds", job.id, rounds)
                        job.emit(Cancelled())
                        return
            finally:
                close = getattr(events, "close", None)
                if close is not None:
                    close()  # closes the member sessions now, not at garbage collection
            self._count("completed")
        except InvalidRequestError as exc:
            self._count("invalid")
            log.info("%s rejected: %s", job.id, exc)
            job.emit(Failed(exc))
        except SpecFuseError as exc:
            self._count("failed")
            log.warning("%s failed: %s", job.id, exc)
            job.emit(Failed(exc))
        except Exception as exc:  # a bug or a backend crash: report it, keep serving
            self._count("failed")
            log.exception("%s crashed", job.id)
            job.emit(Failed(exc))


def _prompt_tokens(members: Sequence[Member], messages: Sequence[Message]) -> dict[str, int]:
    """Templated prompt length per member, where the backend can tell (for usage)."""
    counts: dict[str, int] = {}
    for member in members:
        count = getattr(member, "prompt_tokens", None)
        if callable(count):
            try:
                counts[member.name] = len(count(messages))
            except SpecFuseError:
                pass  # the generation itself reports a bad prompt
    return counts
