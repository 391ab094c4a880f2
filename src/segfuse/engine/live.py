"""The leader's text as it decodes it, when it answers alone (docs/design.md#tokens-as-the-leader-writes-them).

A round in which the leader answers alone has no vote to wait for: its draft
is the round's segment, cut back to whole words (and before any stop string)
once the draft ends. :class:`LeaderStream` is handed to the leader's draft
call as its ``on_text`` hook and hands out, as the draft grows, the part of it
that the cut will surely keep, as ``partial`` segment events; the engine sends
the rest with the round's end. Text once handed out is never taken back.

The hook runs inside a member call, where the engine's coroutine cannot yield:
the call is yielded as :class:`LiveCalls`, and a driver that can hand events
out while calls run (``engine.drive``, ``scheduler.py``) gives its
:class:`Outlet` a listener first. Without a listener nothing is handed out
early and the round streams whole, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..segments import sure_prefix
from ..types import Event, Segment, SegmentEvent
from .calls import Calls

log = logging.getLogger("segfuse.engine")

Listener = Callable[[Event], None]


class Outlet:
    """Where events made during a member call go: a driver's listener, or nowhere."""

    def __init__(self) -> None:
        self.listener: Listener | None = None

    def listen(self, listener: Listener | None) -> None:
        self.listener = listener


class Handoff:
    """Events made on the thread that runs a call, handed to the consumer's thread one at a time.

    The calling thread waits while the consumer handles each event (``give`` returns once the consumer
    says ``taken``), so no thread of ours runs beside llama.cpp's compute threads while they decode: on a
    machine with as many cores as llama.cpp has threads, a consumer's work overlapping a decode stalls the
    decode's thread barriers (measured: the leader alone at 1.35x its own decode time)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._event: Event | None = None
        self._done = False  # the calls ended: nothing more comes
        self._closed = False  # the consumer left: give nothing more, wait for nothing

    def give(self, event: Event) -> None:
        """Hand `event` over and wait until the consumer is done with it (calling thread)."""
        with self._cond:
            if self._closed:
                return
            self._event = event
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._event is None or self._closed)

    def end(self) -> None:
        """The calls are done (calling thread, or a callback of their future)."""
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def take(self) -> Event | None:
        """The next event, or None once the calls are done (consumer's thread)."""
        with self._cond:
            self._cond.wait_for(lambda: self._event is not None or self._done)
            return self._event

    def taken(self) -> None:
        """The consumer is done with the event it took: the calling thread goes on."""
        with self._cond:
            self._event = None
            self._cond.notify_all()

    def close(self) -> None:
        """The consumer leaves: a waiting or later ``give`` returns at once."""
        with self._cond:
            self._closed = True
            self._event = None
            self._cond.notify_all()


@dataclass(frozen=True)
class LiveCalls(Calls):
    """Calls whose hooks may emit events while they run: a driver that can hand them out listens
    on ``outlet`` before running them; one that does not simply runs them."""

    outlet: Outlet = field(default_factory=Outlet)


class LeaderStream:
    """One round's segment as the leader drafts it, handed out as far as it is sure.

    ``on_text`` is the draft's hook (called on the thread that runs the call);
    ``restart`` marks a new draft of the same round (a retry, twice as long).
    ``sent`` is what went out this round: the round's segment starts with it.
    """

    def __init__(
        self, model: str, round_no: int, message: str, stops: tuple[str, ...], outlet: Outlet | None = None
    ) -> None:
        self.model, self.round_no, self.message, self.stops = model, round_no, message, stops
        self.outlet = outlet or Outlet()
        self.sent = ""
        self.first_at: float | None = None  # time.perf_counter() when the first text went out
        self._pieces: list[str] = []  # the current draft's text, cut where the hook was called
        self._lock = threading.Lock()

    def restart(self) -> None:
        self._pieces = []

    def on_text(self, text: str) -> None:
        listener = self.outlet.listener
        if listener is None:
            return
        with self._lock:
            known = "".join(self._pieces)
            if len(text) <= len(known) or not text.startswith(known):
                return  # nothing new (a backend may repeat itself)
            self._pieces.append(text[len(known) :])
            sure = sure_prefix(self._pieces, self.message, self.stops)
            if len(sure) <= len(self.sent) or not sure.startswith(self.sent):
                return
            delta, self.sent = sure[len(self.sent) :], sure
            if self.first_at is None:
                self.first_at = time.perf_counter()
        try:
            listener(SegmentEvent(Segment(delta, self.model, self.round_no), partial=True))
        except Exception:  # a consumer's fault must not fail the leader's draft
            log.exception("handing out the leader's text failed; the round streams whole")
            self.outlet.listen(None)
