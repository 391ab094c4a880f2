"""One worker thread runs the fused generations: up to ``max_concurrent`` at once.

The thread drives a :class:`~specfuse.scheduler.Scheduler`: every tick it
admits queued jobs while a slot is free (first come, first served), advances
every generation in flight by one step and runs their member calls together,
batched where a member can batch (llama.cpp). Requests beyond the slots wait
in a bounded queue (429 beyond it). The worker hands each event to the
request's asyncio queue as it happens; a cancelled job leaves the scheduler
at its next tick (within a round), and closing its coroutine closes its member
sessions. ``max_concurrent = 1`` is the serial worker: one job at a time.
After every tick the thread also notes what each member holds (free slots, KV
cells): only it may read a llama.cpp cache, which must not be read mid-decode.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..backends.base import Member, Occupancy
from ..constraints import Constraint
from ..tools import Tool
from ..ensemble import Ensemble
from ..errors import InvalidRequestError, SpecFuseError
from ..options import FusionOptions
from ..scheduler import Cancelled as FlightCancelled
from ..scheduler import Flight, Scheduler
from ..types import DoneEvent, Event, Message, Result, RoundEvent, SegmentEvent

log = logging.getLogger("specfuse.server")

# accepted/rejected: at the queue; started: picked up by the worker; then each started job ends
# completed, cancelled, invalid (its input was bad, e.g. a prompt too long) or failed (a fault).
COUNTERS = ("accepted", "rejected", "started", "completed", "cancelled", "invalid", "failed", "rounds")


class Observer(Protocol):
    """What watches each generation as it happens (the server's metrics); `accepted` is the job's
    ``time.time()`` at acceptance. Called on the worker thread."""

    def first_segment(self, accepted: float) -> None: ...

    def done(self, accepted: float, result: Result) -> None: ...


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
    constraint: Constraint | None = None  # structured output (response_format, or the tools offered)
    tools: list[Tool] = field(default_factory=list)  # offered: the answer may be a call of one
    logprobs: bool = False  # the response reports each answer token's log-probability
    top_logprobs: int = 0  # and this many alternatives per token, as the drafters report them
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

    def __init__(self, queue_size: int, max_concurrent: int = 1) -> None:
        self.queue_size = queue_size
        self.max_concurrent = max_concurrent
        self.counters: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._ensemble: Ensemble | None = None
        self._waiting: deque[Job] = deque()
        self._running: set[Job] = set()
        self._cond = threading.Condition()
        self._stopping = False
        self._scheduler = Scheduler()
        self._occupancy: dict[str, Occupancy] = {}
        # Told of each generation's first segment and result here, where it happens: a client that
        # left must not make a completed request go unobserved.
        self.observer: Observer | None = None
        self._thread = threading.Thread(target=self._serve, name="specfuse-worker", daemon=True)

    def start(self, ensemble: Ensemble) -> None:
        self._ensemble = ensemble
        # llama.cpp members hold as many sessions as they were loaded with.
        self.max_concurrent = max(1, min(self.max_concurrent, ensemble.slots))
        self._observe()  # the thread has not started: nothing decodes yet
        self._thread.start()

    def _count(self, name: str) -> None:
        with self._cond:  # the worker thread and the event loop both count
            self.counters[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return dict(self.counters)

    def state(self) -> tuple[int, int]:
        """Jobs waiting, jobs in flight."""
        with self._cond:
            return len(self._waiting), len(self._running)

    def occupancy(self) -> dict[str, Occupancy]:
        """What each member held after the worker's last step (all slots free and no cells when idle)."""
        with self._cond:
            return dict(self._occupancy)

    def submit(self, job: Job) -> None:
        """Queue a bound job, or raise QueueFullError when every slot is taken."""
        with self._cond:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down", "retry in a moment")
            free = self.max_concurrent - len(self._running)
            if len(self._waiting) >= self.queue_size + max(0, free):  # queue_size wait behind the running
                self.counters["rejected"] += 1
                raise QueueFullError(
                    f"the request queue is full ({self.queue_size} waiting)", "retry in a little while"
                )
            self._waiting.append(job)
            self.counters["accepted"] += 1
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job: drop it from the queue, or make the worker stop it at its next step.

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
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and wait for the worker to finish its step."""
        with self._cond:
            self._stopping = True
            jobs = list(self._waiting) + list(self._running)
        for job in jobs:
            self.cancel(job)
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ worker thread

    def _serve(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._waiting and not self._running and not self._stopping:
                        self._cond.wait()
                    if self._stopping and not self._waiting and not self._running:
                        return
                    admitted = []
                    while self._waiting and len(self._running) < self.max_concurrent:
                        job = self._waiting.popleft()
                        self._running.add(job)
                        admitted.append(job)
                for job in admitted:
                    try:
                        self._admit(job)
                    except Exception as exc:  # a bug in one admission must not stop the worker for all
                        self._end(job, exc, 0)
                self._scheduler.tick()
                self._observe()
        finally:
            self._scheduler.close()

    def _observe(self) -> None:
        assert self._ensemble is not None
        seen = {}
        for member in self._ensemble.members:
            try:
                seen[member.name] = member.occupancy()
            except Exception:  # a view for operators must never stop the worker
                log.exception("could not read what %s holds", member.name)
                seen[member.name] = Occupancy(member.slots)
        with self._cond:
            self._occupancy = seen

    def _admit(self, job: Job) -> None:
        self._count("started")
        ensemble = self._ensemble
        assert ensemble is not None
        try:
            steps = ensemble.steps(job.messages, job.options, members=job.members, constraint=job.constraint,
                                   top_logprobs=job.top_logprobs)
        except SpecFuseError as exc:
            self._end(job, exc, 0)
            return
        members = [m for m in ensemble.members if job.members is None or m.name in job.members]
        job.emit(Started(time.time() - job.created, _prompt_tokens(members, job.messages)))
        rounds = [0]
        first = [True]

        def on_event(event: Event) -> None:
            if isinstance(event, RoundEvent):
                rounds[0] += 1
                self._count("rounds")
            elif isinstance(event, SegmentEvent) and first[0]:
                first[0] = False
                self._tell(lambda o: o.first_segment(job.created))
            elif isinstance(event, DoneEvent):
                self._tell(lambda o: o.done(job.created, event.result))
            job.emit(event)

        self._scheduler.add(Flight(steps, on_event, lambda why: self._end(job, why, rounds[0]),
                                   job.cancel_flag.is_set))

    def _tell(self, call: Callable[[Observer], None]) -> None:
        if self.observer is None:
            return
        try:
            call(self.observer)
        except Exception:  # metrics must never stop a generation
            log.exception("the observer failed")

    def _end(self, job: Job, why: BaseException | None, rounds: int) -> None:
        with self._cond:
            self._running.discard(job)
        self._finished(job, why, rounds)

    def _finished(self, job: Job, why: BaseException | None, rounds: int) -> None:
        if why is None:
            self._count("completed")
        elif isinstance(why, FlightCancelled):
            self._count("cancelled")
            log.info("%s cancelled after %d rounds", job.id, rounds)
            job.emit(Cancelled())
        elif isinstance(why, InvalidRequestError):
            self._count("invalid")
            log.info("%s rejected: %s", job.id, why)
            job.emit(Failed(why))
        elif isinstance(why, SpecFuseError):
            self._count("failed")
            log.warning("%s failed: %s", job.id, why)
            job.emit(Failed(why))
        else:  # a bug or a backend crash: report it, keep serving
            self._count("failed")
            log.error("%s crashed", job.id, exc_info=why)
            job.emit(Failed(why))


def _prompt_tokens(members: Sequence[Member], messages: Sequence[Message]) -> dict[str, int]:
    """Templated prompt length per member, where the backend can tell (for usage)."""
    counts: dict[str, int] = {}
    for member in members:
        try:
            tokens = member.prompt_tokens(messages)
        except SpecFuseError:
            continue  # the generation itself reports a bad prompt
        if tokens is not None:
            counts[member.name] = len(tokens)
    return counts
