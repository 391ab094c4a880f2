"""Chores the worker thread runs every so often between its steps: writing the members' prefix caches to
their directory (``[members] prefix_cache_dir``, every ``[server] prefix_cache_save_minutes``).

They run on the worker thread because only it may read a llama.cpp member's cache (never mid-decode);
requests that arrive meanwhile wait for the chore to end, as for a step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from ..backends.base import Member

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


def saving_prefix_caches(members: Sequence[Member], minutes: float) -> Periodic | None:
    """The chore that writes `members`' prefix caches every `minutes` (None for 0: only when they close)."""
    if minutes <= 0:
        return None

    def save() -> None:
        for member in members:
            member.save_prefix_cache()

    return Periodic(minutes * 60.0, save, "writing the prefix caches")
