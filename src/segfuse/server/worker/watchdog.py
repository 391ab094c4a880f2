"""The worker's watchdog: a thread that notices a worker step running too long, or the worker's
thread gone, and says so (logged with where the worker is, counted, and the worker told)."""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("segfuse.server")


@dataclass(frozen=True)
class Watched:
    """What the watchdog asks of the worker and tells it.

    `tick_since` gives the ``time.monotonic()`` start of the tick in progress (None between ticks);
    `on_stall` is called once per stalled tick, `on_dead` when the worker thread is gone while it
    should run (`expected` says whether it should)."""

    tick_since: Callable[[], float | None]
    on_stall: Callable[[], None]
    on_dead: Callable[[], None]
    expected: Callable[[], bool]


class Watchdog:
    """Every few seconds: has a tick run too long (said once per tick), has the worker thread died?
    (`watched`: what it asks and tells the worker); the watch ends when `stopped` is set."""

    def __init__(
        self, worker: threading.Thread, stall_after_s: float, watched: Watched, stopped: threading.Event
    ) -> None:
        self.worker, self.stall_after_s, self.stopped = worker, stall_after_s, stopped
        self.tick_since, self.on_stall = watched.tick_since, watched.on_stall
        self.on_dead, self.expected = watched.on_dead, watched.expected
        self._seen: float | None = None  # the tick last reported
        self._thread = threading.Thread(target=self._watch, name="segfuse-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stalled(self) -> str | None:
        """Why the worker looks stuck: a tick running longer than ``stall_after_s``; None when it is not."""
        since = self.tick_since()
        if since is None:
            return None
        age = time.monotonic() - since
        if age <= self.stall_after_s:
            return None
        return f"one worker step has run for {age:.0f} s (more than {self.stall_after_s:g} s)"

    def _watch(self) -> None:
        period = min(5.0, max(0.05, self.stall_after_s / 4))
        while not self.stopped.wait(period):
            since = self.tick_since()
            if since is not None and since != self._seen and time.monotonic() - since > self.stall_after_s:
                self._seen = since
                self.on_stall()
                log.error("the worker is stalled: %s; it is at:\n%s", self.stalled(), self._where())
            if not self.worker.is_alive() and self.expected():
                self.on_dead()
                return

    def _where(self) -> str:
        """The worker thread's current stack (innermost last), for the stall report."""
        frame = sys._current_frames().get(self.worker.ident or -1)
        return "".join(traceback.format_stack(frame)[-8:]) if frame is not None else "(not running)"
