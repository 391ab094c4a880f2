"""The worker's bounded queue: jobs waiting and in flight, the counters, what members hold (as noted).

Its lock (``_cond``) guards all of it. The event loop queues and cancels jobs (``submit``, ``cancel``) and
reads what it holds (``state``, ``view``, ``snapshot``); the worker thread (``thread.py``), which holds
the queue, waits for work and admits jobs (``next``), says when one leaves (``leave``) and what members
hold (``note``), and gives up (``give_up``) through the methods below, never its fields.
``queue_size`` jobs may wait behind ``max_concurrent`` in flight; past that, ``submit`` raises
QueueFullError (429).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable

from ...backends.base import Occupancy
from ...errors import SegfuseError
from .jobs import Cancelled, Failed, Job, QueueFullError, ShuttingDownError

log = logging.getLogger("segfuse.server")

# accepted/rejected: at the queue; started: picked up by the worker; then each started job ends
# completed, cancelled, invalid (its input was bad, e.g. a prompt too long) or failed (a fault).
# worker_errors: ticks that raised (every request in flight failed); stalls: ticks the watchdog saw run too long.
COUNTERS = (
    "accepted",
    "rejected",
    "started",
    "completed",
    "cancelled",
    "invalid",
    "failed",
    "rounds",
    "worker_errors",
    "stalls",
)


class JobQueue:
    """Jobs waiting and in flight, and the counters; see the module's docstring."""

    def __init__(self, queue_size: int, max_concurrent: int = 1) -> None:
        self.queue_size = queue_size
        self.max_concurrent = max_concurrent
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._waiting: deque[Job] = deque()
        self._running: set[Job] = set()
        self._cond = threading.Condition()
        self._stopping = False
        self._occupancy: dict[str, Occupancy] = {}
        self.fatal: str | None = None  # why the worker cannot go on; None while it can

    def count(self, name: str) -> None:
        with self._cond:  # the worker thread and the event loop both count
            self.counters[name] += 1

    @property
    def stopping(self) -> bool:
        """Whether it takes no new work (a shutdown, or a worker that gave up)."""
        with self._cond:
            return self._stopping

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

    def view(self) -> tuple[int, int, dict[str, Occupancy]]:
        """Jobs waiting, jobs in flight and what members hold, read together: with none in flight, what
        members hold was noted after the last job closed its sessions."""
        with self._cond:
            return len(self._waiting), len(self._running), dict(self._occupancy)

    def submit(self, job: Job) -> None:
        """Queue a bound job, or raise QueueFullError when every slot is taken."""
        with self._cond:
            if self.fatal is not None:
                raise ShuttingDownError(
                    f"the server cannot generate any more ({self.fatal})", "retry once it has restarted"
                )
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

    def cancel(self, job: Job, reason: SegfuseError | None = None) -> None:
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
                job.over()
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

    # ------------------------------------------------------------------ the worker thread's side

    def next(self, more: Callable[[], bool], wait_s: Callable[[], float | None]) -> tuple[list[Job], bool] | None:
        """Wait until there is work: jobs waiting or in flight, a shutdown, or `more()` (the worker's chores,
        looked at under the lock; `wait_s()`: the longest wait before looking again, None: until woken).
        Then admit waiting jobs while a slot is free. The jobs admitted and whether any is in flight; None
        when stopping with no job left (the worker ends)."""
        with self._cond:
            while not (self._waiting or self._running or self._stopping or more()):
                self._cond.wait(wait_s())
            if self._stopping and not self._waiting and not self._running:
                return None
            admitted = []
            while self._waiting and len(self._running) < self.max_concurrent:
                job = self._waiting.popleft()
                self._running.add(job)
                admitted.append(job)
            return admitted, bool(self._running)

    def wake(self) -> None:
        """Wake the worker waiting in ``next``: `more()` may be true now (from any thread)."""
        with self._cond:
            self._cond.notify()

    def note(self, occupancy: dict[str, Occupancy]) -> None:
        """What each member holds now, as the worker thread read it between decodes."""
        with self._cond:
            self._occupancy = occupancy

    def leave(self, job: Job, occupancy: dict[str, Occupancy] | None) -> None:
        """`job` is no longer in flight; with what members hold after it (None: not read), noted together."""
        with self._cond:
            self._running.discard(job)
            if occupancy is not None:
                self._occupancy = occupancy

    def in_flight(self) -> list[Job]:
        with self._cond:
            return list(self._running)

    def give_up(self, reason: str) -> list[Job] | None:
        """The worker cannot go on: refuse new jobs (``fatal``) and take the waiting ones out, to be failed;
        None if it had given up already."""
        with self._cond:
            if self.fatal is not None:
                return None
            self.fatal, self._stopping = reason, True
            waiting = list(self._waiting)
            self._waiting.clear()
            return waiting


__all__ = ["COUNTERS", "JobQueue"]
