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

The worker is never silent about its own faults: an exception that escapes a
tick fails every request in flight (each gets a ``Failed`` item), is logged
with its traceback and counted (``worker_errors``); after ``fatal_after``
failed ticks with no generation completed between them, or if the thread dies, ``Worker.fatal`` says why and
``on_fatal`` is called (the server answers 503 on /health and exits). A
watchdog thread notices a tick that runs longer than ``stall_after_s``
(``Worker.stalled``), logs where the worker thread is, and counts it
(``stalls``). A job's ``deadline_s`` ends its answer where it is (finish
reason "deadline", a length limit), or fails it if it is still queued then.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
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
# worker_errors: ticks that raised (every request in flight failed); stalls: ticks the watchdog saw run too long.
COUNTERS = ("accepted", "rejected", "started", "completed", "cancelled", "invalid", "failed", "rounds",
            "worker_errors", "stalls")
STALL_AFTER_S = 120.0  # a tick that runs longer than this is stalled (/health says so)
FATAL_AFTER = 3  # ticks that raise, with no generation completed between them, before the worker gives up


class Observer(Protocol):
    """What watches each generation as it happens (the server's metrics); `accepted` is the job's
    ``time.time()`` at acceptance. Called on the worker thread."""

    def first_segment(self, accepted: float) -> None: ...

    def done(self, accepted: float, result: Result) -> None: ...


class QueueFullError(SpecFuseError):
    """Every queue slot is taken; the client should retry later."""


class ShuttingDownError(SpecFuseError):
    """The server is stopping and takes no new work."""


class WorkerFailedError(SpecFuseError):
    """The worker could not go on (a tick failed, or its thread died); the request was not answered."""


class DeadlineError(SpecFuseError):
    """The request's deadline passed before its generation could start."""


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
    deadline_s: float | None = None  # from acceptance: then the answer so far ends (None: no deadline)
    cache_salt: str | None = None  # prefix-cache isolation: reuse only prefixes cached under the same salt
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: float = field(default_factory=time.time)
    accepted_at: float = field(default_factory=time.monotonic)  # the deadline counts from here
    cancel_flag: threading.Event = field(default_factory=threading.Event)
    cancel_reason: SpecFuseError | None = None  # why the server (not the client) cancelled it, if it did
    _loop: asyncio.AbstractEventLoop | None = None
    _items: asyncio.Queue[Item] | None = None

    @property
    def deadline(self) -> float | None:
        """The ``time.monotonic()`` time its deadline passes, if it has one."""
        return None if self.deadline_s is None else self.accepted_at + self.deadline_s

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

    def __init__(self, queue_size: int, max_concurrent: int = 1, *, stall_after_s: float = STALL_AFTER_S,
                 fatal_after: int = FATAL_AFTER) -> None:
        self.queue_size = queue_size
        self.max_concurrent = max_concurrent
        self.stall_after_s = stall_after_s
        self.fatal_after = fatal_after
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
        self.fatal: str | None = None  # why the worker cannot go on; None while it can
        self.on_fatal: Callable[[str], None] | None = None  # told once, from the worker or watchdog thread
        self._tick_since: float | None = None  # time.monotonic() at the start of the tick in progress
        self._stall_seen: float | None = None  # the tick the watchdog last reported
        self._failed_ticks = 0  # since the last generation that completed
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="specfuse-worker", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="specfuse-watchdog", daemon=True)

    def start(self, ensemble: Ensemble) -> None:
        self._ensemble = ensemble
        # llama.cpp members hold as many sessions as they were loaded with.
        self.max_concurrent = max(1, min(self.max_concurrent, ensemble.slots))
        self._observe()  # the thread has not started: nothing decodes yet
        self._thread.start()
        self._watchdog.start()

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

    @property
    def stalled(self) -> str | None:
        """Why the worker looks stuck: a tick running longer than ``stall_after_s``; None when it is not."""
        since = self._tick_since
        if since is None:
            return None
        age = time.monotonic() - since
        if age <= self.stall_after_s:
            return None
        return f"one worker step has run for {age:.0f} s (more than {self.stall_after_s:g} s)"

    def occupancy(self) -> dict[str, Occupancy]:
        """What each member held after the worker's last step (all slots free and no cells when idle)."""
        with self._cond:
            return dict(self._occupancy)

    def submit(self, job: Job) -> None:
        """Queue a bound job, or raise QueueFullError when every slot is taken."""
        with self._cond:
            if self.fatal is not None:
                raise ShuttingDownError(f"the server cannot generate any more ({self.fatal})",
                                        "retry once it has restarted")
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

    def cancel(self, job: Job, reason: SpecFuseError | None = None) -> None:
        """Stop a job: drop it from the queue, or make the worker stop it at its next step.

        `reason`: why the server stops it (its handler gets ``Failed(reason)``); None: the client
        went away (``Cancelled``). Safe to call more than once and after the job ended.
        """
        with self._cond:
            if job.cancel_flag.is_set():
                return
            job.cancel_reason = reason
            job.cancel_flag.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self.counters["cancelled"] += 1
                log.info("%s cancelled while queued", job.id)
                job.emit(Cancelled() if reason is None else Failed(reason))
            self._cond.notify()

    def begin_shutdown(self) -> None:
        """Take no new work and stop every job (waiting ones at once, running ones at their next step),
        each with a ShuttingDownError, so that open streams end now rather than hold the shutdown up.
        Returns at once; safe from any thread."""
        with self._cond:
            self._stopping = True
            jobs = list(self._waiting) + list(self._running)
        reason = ShuttingDownError("the server is shutting down", "retry in a moment")
        for job in jobs:
            self.cancel(job, reason)
        with self._cond:
            self._cond.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and wait for the worker to finish its step."""
        self.begin_shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._stopped.set()

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
                if not self._step(admitted):
                    return
        except BaseException as exc:  # the loop itself broke: nothing will serve the queue any more
            self._die(f"the worker thread stopped on {type(exc).__name__}", exc)
        finally:
            try:
                self._scheduler.close()
            except Exception:
                log.exception("closing the scheduler failed")

    def _step(self, admitted: Sequence[Job]) -> bool:
        """One tick: admit `admitted`, advance every generation, note what members hold.
        False when the worker gives up (too many failed ticks in a row)."""
        self._tick_since = time.monotonic()
        try:
            for job in admitted:
                try:
                    self._admit(job)
                except Exception as exc:  # a bug in one admission must not stop the worker for all
                    self._end(job, exc, 0)
            self._scheduler.tick()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # a bug, or a native library's panic (pyo3 raises a BaseException)
            self._tick_failed(exc)
            if self._failed_ticks >= self.fatal_after:
                self._die(f"{self._failed_ticks} worker steps failed and no generation completed, the last "
                          f"on {type(exc).__name__}", exc)
                return False
        finally:
            self._tick_since = None
        self._observe()
        return True

    def _tick_failed(self, exc: BaseException) -> None:
        """A tick raised: no generation in flight can be trusted to be consistent; fail them all."""
        self._failed_ticks += 1
        self._count("worker_errors")
        log.error("a worker step failed (%d since a generation last completed); failing the %d requests in flight",
                  self._failed_ticks, len(self._scheduler), exc_info=exc)
        error = WorkerFailedError(f"the server failed while generating ({type(exc).__name__})",
                                  "retry the request")
        self._fail_in_flight(error)

    def _fail_in_flight(self, error: SpecFuseError) -> None:
        self._scheduler.fail_all(error)  # each flight's on_end fails its job
        with self._cond:
            orphans = list(self._running)  # admitted but without a flight (none, unless a bug)
        for job in orphans:
            self._end(job, error, 0)

    def _die(self, reason: str, exc: BaseException | None) -> None:
        """The worker cannot go on: fail every job, refuse new ones, tell ``on_fatal`` (once)."""
        log.critical("the worker cannot go on: %s", reason, exc_info=exc)
        error = WorkerFailedError(f"the server cannot generate any more ({reason})", "retry once it has restarted")
        with self._cond:
            if self.fatal is not None:
                return
            self.fatal = reason
            self._stopping = True
            waiting = list(self._waiting)
            self._waiting.clear()
        try:
            self._fail_in_flight(error)
            for job in waiting:
                self._finished(job, error, 0)
        finally:
            if self.on_fatal is not None:
                try:
                    self.on_fatal(reason)
                except Exception:
                    log.exception("on_fatal failed")

    def _watch(self) -> None:
        """Every few seconds: has a tick run too long (said once per tick), has the worker thread died?"""
        period = min(5.0, max(0.05, self.stall_after_s / 4))
        while not self._stopped.wait(period):
            since = self._tick_since
            if since is not None and since != self._stall_seen and time.monotonic() - since > self.stall_after_s:
                self._stall_seen = since
                self._count("stalls")
                log.error("the worker is stalled: %s; it is at:\n%s", self.stalled, self._where())
            if not self._thread.is_alive() and self.fatal is None and not self._stopping:
                self._die("the worker thread died", None)
                return

    def _where(self) -> str:
        """The worker thread's current stack (innermost last), for the stall report."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        return "".join(traceback.format_stack(frame)[-8:]) if frame is not None else "(not running)"

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
        deadline = job.deadline
        if deadline is not None and time.monotonic() >= deadline:
            self._end(job, DeadlineError(
                f"the request waited {time.monotonic() - job.accepted_at:.0f} s in the queue, past its deadline "
                f"of {job.deadline_s:g} s", "retry when the server is less busy"), 0)
            return
        try:
            steps = ensemble.steps(job.messages, job.options, members=job.members, constraint=job.constraint,
                                   top_logprobs=job.top_logprobs, deadline=deadline, cache_salt=job.cache_salt)
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

        # The leader's text as it decodes it, unless the answer's log-probabilities are asked for: they
        # come with whole segments (and with tools offered the text is held to the end anyway).
        self._scheduler.add(Flight(steps, on_event, lambda why: self._end(job, why, rounds[0]),
                                   job.cancel_flag.is_set, live=not job.logprobs))

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
            self._failed_ticks = 0  # the worker works: earlier failures were passing ones
        elif isinstance(why, FlightCancelled):
            self._count("cancelled")
            log.info("%s cancelled after %d rounds", job.id, rounds)
            job.emit(Cancelled() if job.cancel_reason is None else Failed(job.cancel_reason))
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
