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
runs its ``periodic`` chore when due (``periodic.py``: writing the prefix caches), and what other
threads asked of it (``between_ticks``: the pool frees members there).
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
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from ...backends.base import Member, Occupancy
from ...engine import Scheduler
from ...ensemble import Ensemble
from ...errors import SegfuseError
from .job_queue import JobQueue
from .jobs import Job, Observer, WorkerFailedError, ending, flight_of, start_job, tell
from .periodic import Chores, Periodic, run_one
from .watchdog import Watchdog, Watched

log = logging.getLogger("segfuse.server")

__all__ = ["Worker", "read_occupancy"]

STALL_AFTER_S = 120.0  # a tick that runs longer than this is stalled (/health says so)
FATAL_AFTER = 3  # ticks that raise, with no generation completed between them, before the worker gives up


class Worker:
    """The thread that serves the bounded queue (``queue``: where the event loop submits and cancels jobs
    and reads what it holds)."""

    def __init__(
        self,
        queue_size: int,
        max_concurrent: int = 1,
        *,
        stall_after_s: float = STALL_AFTER_S,
        fatal_after: int = FATAL_AFTER,
    ) -> None:
        self.queue = JobQueue(queue_size, max_concurrent)
        self.stall_after_s = stall_after_s
        self.fatal_after = fatal_after
        self._ensemble: Ensemble | None = None
        self._scheduler = Scheduler()
        # Told of each generation's first segment and result here, where it happens: a client that
        # left must not make a completed request go unobserved.
        self.observer: Observer | None = None
        self.on_fatal: Callable[[str], None] | None = None  # told once, from the worker or watchdog thread
        self.periodic: Periodic | None = None  # a chore run on the worker thread between ticks when due
        self._chores = Chores()  # one-off chores other threads asked for (between_ticks)
        self._serving = False  # the thread takes chores (else whoever asks runs them)
        self._serving_lock = threading.Lock()  # a chore is taken while the thread serves, or run by whoever asks
        self._tick_since: float | None = None  # time.monotonic() at the start of the tick in progress
        self._failed_ticks = 0  # since the last generation that completed
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="segfuse-worker", daemon=True)
        watched = Watched(
            lambda: self._tick_since,
            lambda: self.queue.count("stalls"),
            lambda: self._die("the worker thread died", None),
            lambda: self.fatal is None and not self.queue.stopping,
        )
        self._watchdog = Watchdog(self._thread, stall_after_s, watched, self._stopped)

    def start(self, ensemble: Ensemble) -> None:
        """Serve `ensemble` (its members may come and go: ``between_ticks``)."""
        self._ensemble = ensemble
        if ensemble.members:  # llama.cpp members hold as many sessions as they were loaded with
            self.queue.max_concurrent = max(1, min(self.queue.max_concurrent, ensemble.slots))
        self._observe()  # the thread has not started: nothing decodes yet
        self._serving = True
        self._thread.start()
        self._watchdog.start()

    def between_ticks(self, chore: Callable[[], object]) -> Future[None]:
        """Run `chore` on the worker thread between two steps (at once, here, when the thread is not
        serving: nothing decodes then); its Future ends when it has run."""
        with self._serving_lock:
            if self._serving:
                future = self._chores.add(chore)
                self.queue.wake()
                return future
        return run_one(chore, Future())

    @property
    def fatal(self) -> str | None:
        """Why the worker cannot go on (its queue refuses new jobs); None while it can."""
        return self.queue.fatal

    @property
    def stalled(self) -> str | None:
        """Why the worker looks stuck: a tick running longer than ``stall_after_s``; None when it is not."""
        return self._watchdog.stalled()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and wait for the worker to finish its step."""
        self.queue.begin_shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._stopped.set()

    # ------------------------------------------------------------------ worker thread

    def _serve(self) -> None:
        try:
            while True:
                taken = self.queue.next(lambda: bool(self._chores) or self._chore_due(), self._wait_s)
                if taken is None:
                    return
                admitted, busy = taken
                self._chores.run()
                if self._chore_due():
                    assert self.periodic is not None
                    self.periodic.run()
                if busy and not self._step(admitted):
                    return
        except BaseException as exc:  # the loop itself broke: nothing will serve the queue any more
            self._die(f"the worker thread stopped on {type(exc).__name__}", exc)
        finally:
            with self._serving_lock:
                self._serving = False
            self._chores.run()  # those asked before it stopped
            try:
                self._scheduler.close()
            except Exception:
                log.exception("closing the scheduler failed")

    def _chore_due(self) -> bool:
        return self.periodic is not None and self.periodic.due()

    def _wait_s(self) -> float | None:
        """The longest the idle thread waits: until the periodic chore is due (None: until woken)."""
        return None if self.periodic is None else self.periodic.wait_s()

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
        self.queue.count("worker_errors")
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
        orphans = self.queue.in_flight()  # admitted but without a flight (none, unless a bug)
        for job in orphans:
            self._end(job, error, 0)

    def _die(self, reason: str, exc: BaseException | None) -> None:
        """The worker cannot go on: fail every job, refuse new ones, tell ``on_fatal`` (once)."""
        log.critical("the worker cannot go on: %s", reason, exc_info=exc)
        error = WorkerFailedError(f"the server cannot generate any more ({reason})", "retry once it has restarted")
        waiting = self.queue.give_up(reason)
        if waiting is None:  # it gave up already
            return
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
        self.queue.note(self._read_occupancy())

    def _read_occupancy(self) -> dict[str, Occupancy]:
        """What each member holds now; on the worker thread, between decodes (or before it starts)."""
        assert self._ensemble is not None
        return read_occupancy(self._ensemble.members)

    def _admit(self, job: Job) -> None:
        self.queue.count("started")
        assert self._ensemble is not None
        steps = start_job(job, self._ensemble, self._end)
        if steps is not None:
            count = self.queue.count
            self._scheduler.add(flight_of(job, steps, count, lambda call: tell(self.observer, call), self._end))

    def _end(self, job: Job, why: BaseException | None, rounds: int) -> None:
        """`job` is over and its sessions closed: it leaves the jobs in flight together with a fresh note of
        what members hold, and only then is its handler told (its result goes out)."""
        # Elsewhere (the thread died) the cache is not ours to read.
        seen = self._read_occupancy() if threading.current_thread() is self._thread else None
        self.queue.leave(job, seen)
        self._finished(job, why, rounds)

    def _finished(self, job: Job, why: BaseException | None, rounds: int) -> None:
        if why is None:
            self._failed_ticks = 0  # the worker works: earlier failures were passing ones
        ending(job, why, rounds, self.queue.count)


def read_occupancy(members: Sequence[Member]) -> dict[str, Occupancy]:
    """What each member holds now (a member that cannot tell: all its slots free)."""
    seen = {}
    for member in members:
        try:
            seen[member.name] = member.occupancy()
        except Exception:  # a view for operators must never stop the worker
            log.exception("could not read what %s holds", member.name)
            seen[member.name] = Occupancy(member.slots)
    return seen
