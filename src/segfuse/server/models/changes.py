"""What wakes a request waiting for the pool to change: ``Changes`` (``pool.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

WAKE_S = 1.0  # the longest a request waiting for the pool to change sleeps without news (a safety net)


class Changes:
    """What wakes a request waiting for the pool to change (a member let go, closed, loaded, or failed to
    load): ``tell`` from any thread (the worker's lets members go and closes them), ``until`` on the event
    loop, woken through it (``call_soon_threadsafe``)."""

    def __init__(self) -> None:
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None  # made by the first waiter

    def tell(self) -> None:
        """The pool changed: wake whoever waits (from any thread; nothing to do before anyone waited)."""
        waker = self._waker
        if waker is None:
            return
        loop, event = waker
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # that event loop is closed: nothing waits on it any more
            pass

    async def until(self, ready: Callable[[], bool], deadline: float | None) -> bool:
        """Wait until `ready()`, looked at again after each change (and every ``WAKE_S``, a safety net);
        False when `deadline` (time.monotonic(); None: none) comes first."""
        loop = asyncio.get_running_loop()
        if self._waker is None or self._waker[0] is not loop:
            self._waker = (loop, asyncio.Event())
        event = self._waker[1]
        while True:
            event.clear()  # before looking: a change from here on sets it again, and the wait returns
            if ready():
                return True
            left = WAKE_S if deadline is None else min(WAKE_S, deadline - time.monotonic())
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                pass
