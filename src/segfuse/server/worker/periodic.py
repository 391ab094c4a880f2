"""Chores the worker thread runs between its steps: every so often, writing the members' prefix caches to
their directory (``[members] prefix_cache_dir``, every ``[server] prefix_cache_save_minutes``); once, what
another thread asks (``Chores``: the pool frees a member there).

They run on the worker thread because only it may read a llama.cpp member's cache (never mid-decode),
and nothing decodes with a member between two steps; requests that arrive meanwhile wait for the chore
to end, as for a step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from ...backends.base import Member

log = logging.getLogger("segfuse.server")


class Periodic:
    """`chore` every `every_s` seconds, the first `every_s` after it is made; a failure is logged, never raised."""

    def __init__(self, every_s: float, chore: Callable[[], object], what: str) -> None:
        self.every_s, self.chore, self.what = every_s, chore, what
        self._next = time.monotonic() + every_s

    def wait_s(self) -> float:
        """Seconds until it is due (0: now)."""
        return max(0.0, self._next - time.monotonic())

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def run(self) -> None:
        try:
            self.chore()
        except Exception:  # a chore must never stop the worker
            log.exception("%s failed", self.what)
        finally:
            self._next = time.monotonic() + self.every_s


class Chores:
    """One-off chores, queued from any thread, each run once with a Future for whoever asked."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Callable[[], object], Future[None]]] = deque()
        self._lock = threading.Lock()

    def add(self, chore: Callable[[], object]) -> Future[None]:
        future: Future[None] = Future()
        with self._lock:
            self._queue.append((chore, future))
        return future

    def __bool__(self) -> bool:
        return bool(self._queue)

    def run(self) -> None:
        """Every chore queued, in order: its Future gets its end, or what it raised."""
        while True:
            with self._lock:
                if not self._queue:
                    return
                chore, future = self._queue.popleft()
            run_one(chore, future)


def run_one(chore: Callable[[], object], future: Future[None]) -> Future[None]:
    try:
        chore()
    except BaseException as exc:  # told to whoever waits for it; the worker goes on
        log.exception("a chore failed")
        future.set_exception(exc)
    else:
        future.set_result(None)
    return future


def saving_prefix_caches(members: Callable[[], Sequence[Member]], minutes: float) -> Periodic | None:
    """The chore that writes the prefix caches of the members held then (`members()`) every `minutes`
    (None for 0: only when they close)."""
    if minutes <= 0:
        return None

    def save() -> None:
        for member in members():
            member.save_prefix_cache()

    return Periodic(minutes * 60.0, save, "writing the prefix caches")
