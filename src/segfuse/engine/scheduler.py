"""Many fused generations at once: advance them together, batching their member calls.

Each generation is the engine's coroutine (:func:`segfuse.engine.fusion_steps`).
One :meth:`Scheduler.tick` runs every generation in flight up to its next
member calls that decode (handing its events out on the way), then runs all those calls
together through a :class:`~segfuse.engine.calls.CallRunner` (a ``live`` flight's calls hand
out the leader's text while they run: ``live.py``): calls of one method to
one member that can batch (llama.cpp) become one batched call, remote calls
overlap in threads. Every flight advances by one step per tick, so none starves.

A generation that ends, fails (a bad request, every member lost) or is
cancelled leaves the scheduler alone; the others go on. Member faults inside a
generation are the engine's business: the member leaves that request only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..types import DoneEvent, Event, Result
from .calls import CallRunner, Calls, Reply
from .crowd import advancing_together
from .live import LiveCalls
from .loop import Steps

log = logging.getLogger("segfuse.engine.scheduler")


@dataclass(eq=False)
class Flight:
    """One generation in progress and where its output goes."""

    steps: Steps
    on_event: Callable[[Event], None]
    on_end: Callable[[BaseException | None], None]  # None: finished normally; else why it stopped
    cancelled: Callable[[], bool] = lambda: False
    live: bool = False  # hand out the events its calls make while they run (the leader's text), at once
    pending: Calls | None = None
    reply: list[Reply] | None = None
    ended: bool = field(default=False, init=False)


class FlightCancelled(Exception):
    """Handed to ``Flight.on_end`` when a generation stopped because it was cancelled."""


class Scheduler:
    """Generations in flight and the loop step that advances them all."""

    def __init__(self, runner: CallRunner | None = None) -> None:
        self.runner = runner or CallRunner()
        self.flights: list[Flight] = []

    def add(self, flight: Flight) -> None:
        self.flights.append(flight)

    def __len__(self) -> int:
        return len(self.flights)

    def tick(self) -> None:
        """Advance every flight to its next member calls, then run all those calls."""
        with advancing_together(len(self.flights)):
            for flight in list(self.flights):
                self._advance(flight)
        waiting = [(f, f.pending) for f in self.flights if f.pending is not None]
        for flight, pending in waiting:
            if flight.live and isinstance(pending, LiveCalls):
                pending.outlet.listen(flight.on_event)  # called on the thread that runs the call
        calls = [call for _, pending in waiting for call in pending.calls]
        replies = self.runner.run(calls) if calls else []
        at = 0
        for flight, pending in waiting:
            n = len(pending.calls)
            flight.reply, flight.pending = replies[at : at + n], None
            at += n

    def _advance(self, flight: Flight) -> None:
        if flight.cancelled():
            self._end(flight, FlightCancelled())
            return
        reply, flight.reply = flight.reply, None
        try:
            while True:
                item = flight.steps.send(reply)
                if isinstance(item, Calls):
                    if item.cheap:  # decodes nothing: run it now, so the flights stay in step and
                        reply = self.runner.run(item.calls)  # the next tick's draft batches stay full
                        continue
                    flight.pending = item
                    return
                reply = None
                flight.on_event(item)
                if flight.cancelled() and not isinstance(item, DoneEvent):
                    self._end(flight, FlightCancelled())
                    return
        except StopIteration:
            self._end(flight, None)
        except Exception as exc:  # the request is bad, or no member is left: this flight only
            self._end(flight, exc)

    def _end(self, flight: Flight, why: BaseException | None) -> None:
        if flight.ended:
            return
        flight.ended = True
        if flight in self.flights:
            self.flights.remove(flight)
        try:
            flight.steps.close()  # closes its member sessions now
        except Exception:  # a session that cannot close must not keep the flight (or the others) alive
            log.exception("closing a generation failed")
        flight.on_end(why)

    def cancel_all(self) -> None:
        self.fail_all(FlightCancelled())

    def fail_all(self, why: BaseException) -> None:
        """End every flight with `why` (a step of the loop itself failed: none of them can be trusted)."""
        for flight in list(self.flights):
            try:
                self._end(flight, why)
            except Exception:  # its on_end failed: the others still end
                log.exception("ending a generation failed")

    def close(self) -> None:
        self.cancel_all()
        self.runner.close()


def run_all(
    generations: Sequence[Steps], max_concurrent: int, runner: CallRunner | None = None
) -> list[Result | BaseException]:
    """Run generations with at most `max_concurrent` in flight; each one's Result or error, in order."""
    if max_concurrent < 1:
        raise ValueError("max_concurrent must be at least 1")
    scheduler = Scheduler(runner)
    outcome: list[Result | BaseException | None] = [None] * len(generations)
    queue = list(enumerate(generations))

    def flight(i: int, steps: Steps) -> Flight:
        def on_event(event: Event) -> None:
            if isinstance(event, DoneEvent):
                outcome[i] = event.result

        def on_end(why: BaseException | None) -> None:
            if why is not None:
                outcome[i] = why

        return Flight(steps, on_event, on_end)

    try:
        while queue or scheduler.flights:
            while queue and len(scheduler) < max_concurrent:
                scheduler.add(flight(*queue.pop(0)))
            scheduler.tick()
    finally:
        scheduler.close()
    return [o if o is not None else RuntimeError("the generation ended without a result") for o in outcome]
