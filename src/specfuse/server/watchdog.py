"""The worker's watchdog: a thread that notices a worker step running too long, or the worker's
thread gone, and says so (logged with where the worker is, counted, and ``on_fatal`` told)."""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("specfuse.server")


class Watchdog:
    """Every few seconds: has a tick run too long (said once per tick), has the worker thread died?"""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._seen: float | None = None  # the tick last reported
        self._thread = threading.Thread(target=self._watch, name="specfuse-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stalled(self) -> str | None:
        """Why the worker looks stuck: a tick running longer than ``stall_after_s``; None when it is not."""
        w = self.worker
        since = w._tick_since
        if since is None:
            return None
        age = time.monotonic() - since
        if age <= w.stall_after_s:
            return None
        return f"one worker step has run for {age:.0f} s (more than {w.stall_after_s:g} s)"

    def _watch(self) -> None:
        w = self.worker
        period = min(5.0, max(0.05, w.stall_after_s / 4))
        while not w._stopped.wait(period):
            since = w._tick_since
            if since is not None and since != self._seen and time.monotonic() - since > w.stall_after_s:
                self._seen = since
                w._count("stalls")
                log.error("the worker is stalled: %s; it is at:\n%s", self.stalled(), self._where())
            if not w._thread.is_alive() and w.fatal is None and not w._stopping:
                w._die("the worker thread died", None)
                return

    def _where(self) -> str:
        """The worker thread's current stack (innermost last), for the stall report."""
        frame = sys._current_frames().get(self.worker._thread.ident or -1)
        return "".join(traceback.format_stack(frame)[-8:]) if frame is not None else "(not running)"
