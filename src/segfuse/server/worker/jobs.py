"""A request's generation as the server's handlers and the worker share it: the job, the items it
hands its handler (started, events, failed, cancelled), the errors a job can end with, and how a
job's generation is reported as it runs (:func:`flight_of`) and when it ends (:func:`ending`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ...backends.base import Member
from ...engine import Flight, FlightCancelled, Steps
from ...ensemble import Ensemble
from ...errors import InvalidRequestError, SegfuseError
from ...request import FusionRequest
from ...tools import Tool
from ...types import DoneEvent, Event, Message, Result, RoundEvent, SegmentEvent

log = logging.getLogger("segfuse.server")


class Observer(Protocol):
    """What watches each generation as it happens (the server's metrics); `accepted` is the job's
    ``time.time()`` at acceptance. Called on the worker thread."""

    def first_segment(self, accepted: float) -> None: ...

    def done(self, accepted: float, result: Result) -> None: ...


class QueueFullError(SegfuseError):
    """Every queue slot is taken; the client should retry later."""


class ShuttingDownError(SegfuseError):
    """The server is stopping and takes no new work."""


class WorkerFailedError(SegfuseError):
    """The worker could not go on (a tick failed, or its thread died); the request was not answered."""


class DeadlineError(SegfuseError):
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


@dataclass(frozen=True)
class Worked:
    """A work job's value (see ``Job.work``)."""

    value: object


Item = Started | Event | Failed | Cancelled | Worked


@dataclass(eq=False)
class Job:
    """One request's generation, shared between its HTTP handler and the worker: the generation asked
    for, and what is the server's own (the tools offered, whether log-probabilities are reported, its
    id and timing, its cancel flag and the queue of items for its handler)."""

    # The messages, options, members (None: the whole ensemble), constraint (response_format, or the
    # tools offered), top log-probabilities, deadline (then the answer so far ends; a job still queued
    # fails) and cache salt. A work job's has no messages: its work reads what it reads.
    fusion: FusionRequest
    tools: list[Tool] = field(default_factory=list)  # offered: the answer may be a call of one
    streamed: bool = True  # the answer goes out as it is written (else whole, once: no text handed out before)
    logprobs: bool = False  # the response reports each answer token's log-probability (and request.top_logprobs)
    # Instead of a generation, one call on the worker thread with the ensemble (reading an echoed
    # prompt: bounded by the members' windows); its value comes back as ``Worked``.
    work: Callable[[Ensemble], object] | None = None
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: float = field(default_factory=time.time)
    accepted_at: float = field(default_factory=time.monotonic)  # time.monotonic(): the deadline counts from here
    cancel_flag: threading.Event = field(default_factory=threading.Event)
    cancel_reason: SegfuseError | None = None  # why the server (not the client) cancelled it, if it did
    # Its result (the DoneEvent, or a work job's Worked), held back until the worker has let the job go
    # (``ending``): a client that has its whole answer finds the job no longer in flight, its slots free.
    result: Item | None = None
    # Told once when the worker lets the job go (its sessions closed), or when it never ran: the pool
    # lets its members go then (``Lease.hold``).
    on_over: Callable[[], None] | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _items: asyncio.Queue[Item] | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items = asyncio.Queue()

    def over(self) -> None:
        """The job holds nothing any more: tell ``on_over`` (once)."""
        told, self.on_over = self.on_over, None
        if told is not None:
            told()

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
            if isinstance(item, DoneEvent | Failed | Cancelled | Worked):
                return


def prompt_tokens(members: Sequence[Member], messages: Sequence[Message]) -> dict[str, int]:
    """Templated prompt length per member, where the backend can tell (for usage)."""
    counts: dict[str, int] = {}
    for member in members:
        try:
            tokens = member.prompt_tokens(messages)
        except SegfuseError:
            continue  # the generation itself reports a bad prompt
        if tokens is not None:
            counts[member.name] = len(tokens)
    return counts


def flight_of(
    job: Job,
    steps: Steps,
    count: Callable[[str], None],
    tell: Callable[[Callable[[Observer], None]], None],
    end: Callable[[Job, BaseException | None, int], None],
) -> Flight:
    """The scheduler's flight for `job`: its events go to the job's handler as they happen, rounds are
    counted, the observer hears of the first text and the result; `end` is told how it ended."""
    rounds = [0]
    first = [True]

    def on_event(event: Event) -> None:  # on the worker thread, or the thread of a member's call
        if isinstance(event, RoundEvent):
            rounds[0] += 1
            count("rounds")
        elif isinstance(event, SegmentEvent) and first[0]:
            first[0] = False
            tell(lambda o: o.first_segment(job.created))
        elif isinstance(event, DoneEvent):
            tell(lambda o: o.done(job.created, event.result))
            job.result = event  # handed over when the job ends
            return
        job.emit(event)

    # The leader's text as it decodes it, for a streamed answer whose log-probabilities are not asked
    # for: they come with whole segments (and with tools offered the text is held to the end anyway). A
    # whole answer gains nothing from it, and each token's event would wake the handler's loop.
    live = job.streamed and not job.logprobs
    return Flight(steps, on_event, lambda why: end(job, why, rounds[0]), job.cancel_flag.is_set, live=live)


def run_work(job: Job, ensemble: Ensemble, end: Callable[[Job, BaseException | None, int], None]) -> None:
    """Run a work job's call (``Job.work``) and end it: its value as ``Worked``, or its failure to `end`
    (a text over a window is invalid; anything else failed)."""
    assert job.work is not None
    job.emit(Started(time.time() - job.created, {}))
    try:
        value = job.work(ensemble)
    except Exception as exc:
        end(job, exc, 0)
        return
    job.result = Worked(value)
    end(job, None, 0)


def start_job(job: Job, ensemble: Ensemble, end: Callable[[Job, BaseException | None, int], None]) -> Steps | None:
    """On the worker thread, as it admits `job`: its generation's steps, its Started told; or None when
    it ended here (past its deadline, refused, or a work job run now, as the members are this thread's)."""
    fusion = job.fusion
    if fusion.deadline is not None and time.monotonic() >= fusion.deadline:
        waited = time.monotonic() - job.accepted_at
        error = DeadlineError(
            f"the request waited {waited:.0f} s in the queue, past its deadline of "
            f"{fusion.deadline - job.accepted_at:g} s",
            "retry when the server is less busy",
        )
        end(job, error, 0)
        return None
    if job.work is not None:
        run_work(job, ensemble, end)
        return None
    try:
        steps = ensemble.steps(fusion)
    except SegfuseError as exc:
        end(job, exc, 0)
        return None
    job.emit(Started(time.time() - job.created, prompt_tokens(ensemble.pick(fusion.members), fusion.messages)))
    return steps


def tell(observer: Observer | None, call: Callable[[Observer], None]) -> None:
    """Tell the observer (if any) what happened; metrics must never stop a generation."""
    if observer is None:
        return
    try:
        call(observer)
    except Exception:
        log.exception("the observer failed")


def ending(job: Job, why: BaseException | None, rounds: int, count: Callable[[str], None]) -> None:
    """Count how `job` ended, then tell its handler: its result, or why it has none. Called once the job
    holds nothing and counts in flight no more."""
    told: Item | None = None
    if why is None:
        count("completed")
    elif isinstance(why, FlightCancelled):
        count("cancelled")
        log.info("%s cancelled after %d rounds", job.id, rounds)
        told = Cancelled() if job.cancel_reason is None else Failed(job.cancel_reason)
    elif isinstance(why, InvalidRequestError):
        count("invalid")
        log.info("%s rejected: %s", job.id, why)
        told = Failed(why)
    elif isinstance(why, SegfuseError):
        count("failed")
        log.warning("%s failed: %s", job.id, why)
        told = Failed(why)
    else:  # a bug or a backend crash: report it, keep serving
        count("failed")
        log.error("%s crashed", job.id, exc_info=why)
        told = Failed(why)
    job.over()  # before its handler hears: a client with its answer finds its members let go
    for item in (job.result, told):  # a failure after the result (closing its sessions) does not take it back
        if item is not None:
            job.emit(item)
