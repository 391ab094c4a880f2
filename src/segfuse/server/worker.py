"""One worker thread runs the fused generations: up to ``max_concurrent`` at once.

The thread drives a :class:`~segfuse.engine.scheduler.Scheduler`: every tick it
admits queued jobs while a slot is free (first come, first served), advances
every generation in flight by one step and runs their member calls together,
batched where a member can batch (llama.cpp). Requests beyond the slots wait
in a bounded queue (429 beyond it). The worker hands each event to the
request's asyncio queue as it happens; a cancelled job leaves the scheduler
at its next tick (within a round), and closing its coroutine closes its member
sessions. ``max_concurrent = 1`` is the serial worker: one job at a time.
After every tick the thread also notes what each member holds (free slots, KV
cells): only it may read a llama.cpp cache, which must not be read mid-decode.
A job that ends leaves the count of jobs in flight together with a fresh note
(its sessions are closed by then), and only then does its handler get its
result: a client that has its whole answer, asking /health at once, never sees
its request still in flight, nor the slot it held. Between ticks (or idle) it
runs its ``periodic`` chore when due (``periodic.py``: writing the prefix caches).
The job and what it hands its handler are in ``jobs.py``; the watchdog is in ``watchdog.py``.

The worker is never silent about its own faults: an exception that escapes a
tick fails every request in flight (each gets a ``Failed`` item), is logged
with its traceback and counted (``worker_errors``); after ``fatal_after``
failed ticks with no generation completed between them, or if the thread dies, ``Worker.fatal`` says why and
``on_fatal`` is called (the server answers 503 on /health and exits). A
watchdog thread notices a tick that runs longer than ``stall_after_s``
(``Worker.stalled``), logs where the worker thread is, and counts it
(``stalls``). A job's deadline (its request's) ends its answer where it is
(finish reason "deadline", a length limit), or fails it if it is still queued then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence

from ..backends.base import Occupancy
from ..engine import Scheduler
from ..ensemble import Ensemble
from ..errors import SegfuseError
from .jobs import (
    Cancelled,
    DeadlineError,
    Failed,
    Item,
    Job,
    Observer,
    QueueFullError,
    ShuttingDownError,
    Started,
    Worked,
    WorkerFailedError,
    ending,
    flight_of,
    prompt_tokens,
    run_work,
    tell,
)
from .periodic import Periodic
from .watchdog import Watchdog, Watched

log = logging.getLogger("segfuse.server")

__all__ = [
    "COUNTERS",
    "Cancelled",
    "DeadlineError",
    "Failed",
    "Item",
    "Job",
    "Observer",
    "QueueFullError",
    "ShuttingDownError",
    "Started",
    "Worked",
    "Worker",
    "WorkerFailedError",
]

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
STALL_AFTER_S = 120.0  # a tick that runs longer than this is stalled (/health says so)
FATAL_AFTER = 3  # ticks that raise, with no generation completed between them, before the worker gives up


class Worker:
    """The bounded queue and the thread that serves it."""

    def __init__(
        self,
        queue_size: int,
        max_concurrent: int = 1,
        *,
        stall_after_s: float = STALL_AFTER_S,
        fatal_after: int = FATAL_AFTER,
    ) -> None:
        self.queue_size = queue_size
        self.max_concurrent = max_concurrent
        self.stall_after_s = stall_after_s
        self.fatal_after = fatal_after
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
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
        self.periodic: Periodic | None = None  # a chore run on the worker thread between ticks when due
        self._tick_since: float | None = None  # time.monotonic() at the start of the tick in progress
        self._failed_ticks = 0  # since the last generation that completed
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="segfuse-worker", daemon=True)
        watched = Watched(
            lambda: self._tick_since,
            lambda: self._count("stalls"),
            lambda: self._die("the worker thread died", None),
            lambda: self.fatal is None and not self._stopping,
        )
        self._watchdog = Watchdog(self._thread, stall_after_s, watched, self._stopped)

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
        return self._watchdog.stalled()

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
                    while not self._waiting and not self._running and not self._stopping and not self._chore_due():
                        self._cond.wait(None if self.periodic is None else self.periodic.wait_s())
                    if self._stopping and not self._waiting and not self._running:
                        return
                    admitted = []
                    while self._waiting and len(self._running) < self.max_concurrent:
                        job = self._waiting.popleft()
                        self._running.add(job)
                        admitted.append(job)
                    busy = bool(self._running)
                if self._chore_due():
                    assert self.periodic is not None
                    self.periodic.run()
                if busy and not self._step(admitted):
                    return
        except BaseException as exc:  # the loop itself broke: nothing will serve the queue any more
            self._die(f"the worker thread stopped on {type(exc).__name__}", exc)
        finally:
            try:
                self._scheduler.close()
            except Exception:
                log.exception("closing the scheduler failed")

    def _chore_due(self) -> bool:
        return self.periodic is not None and self.periodic.due()

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
                self._die(
                    f"{self._failed_ticks} worker steps failed and no generation completed, the last "
                    f"on {type(exc).__name__}",
                    exc,
                )
                return False
        finally:
            self._tick_since = None
        self._observe()
        return True

    def _tick_failed(self, exc: BaseException) -> None:
        """A tick raised: no generation in flight can be trusted to be consistent; fail them all."""
        self._failed_ticks += 1
        self._count("worker_errors")
        log.error(
            "a worker step failed (%d since a generation last completed); failing the %d requests in flight",
            self._failed_ticks,
            len(self._scheduler),
            exc_info=exc,
        )
        error = WorkerFailedError(f"the server failed while generating ({type(exc).__name__})", "retry the request")
        self._fail_in_flight(error)

    def _fail_in_flight(self, error: SegfuseError) -> None:
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

    def _observe(self) -> None:
        seen = self._read_occupancy()
        with self._cond:
            self._occupancy = seen

    def _read_occupancy(self) -> dict[str, Occupancy]:
        """What each member holds now; on the worker thread, between decodes (or before it starts)."""
        assert self._ensemble is not None
        seen = {}
        for member in self._ensemble.members:
            try:
                seen[member.name] = member.occupancy()
            except Exception:  # a view for operators must never stop the worker
                log.exception("could not read what %s holds", member.name)
                seen[member.name] = Occupancy(member.slots)
        return seen

    def _admit(self, job: Job) -> None:
        self._count("started")
        ensemble = self._ensemble
        assert ensemble is not None
        request = job.request
        if request.deadline is not None and time.monotonic() >= request.deadline:
            self._end(
                job,
                DeadlineError(
                    f"the request waited {time.monotonic() - job.accepted_at:.0f} s in the queue, past its deadline "
                    f"of {request.deadline - job.accepted_at:g} s",
                    "retry when the server is less busy",
                ),
                0,
            )
            return
        if job.work is not None:  # one call, now, on this thread (the members are this thread's)
            run_work(job, ensemble, self._end)
            return
        try:
            steps = ensemble.steps(request)
        except SegfuseError as exc:
            self._end(job, exc, 0)
            return
        job.emit(Started(time.time() - job.created, prompt_tokens(ensemble.pick(request.members), request.messages)))
        self._scheduler.add(flight_of(job, steps, self._count, lambda call: tell(self.observer, call), self._end))

    def _end(self, job: Job, why: BaseException | None, rounds: int) -> None:
        """`job` is over and its sessions closed: it leaves the jobs in flight together with a fresh note of
        what members hold, and only then is its handler told (its result goes out)."""
        seen = self._read_occupancy() if threading.current_thread() is self._thread else None
        with self._cond:
            self._running.discard(job)
            if seen is not None:  # elsewhere (the thread died) the cache is not ours to read
                self._occupancy = seen
        self._finished(job, why, rounds)

    def _finished(self, job: Job, why: BaseException | None, rounds: int) -> None:
        if why is None:
            self._failed_ticks = 0  # the worker works: earlier failures were passing ones
        ending(job, why, rounds, self._count)
