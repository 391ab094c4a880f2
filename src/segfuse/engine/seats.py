"""Members' places in one generation: sessions, who is active, who left and why.

Every member call of a generation goes through :meth:`Seats.ask`, which yields
it as data (``calls.py``), times it per phase and hands back each seat's result
or exception. Seats whose call raised leave the query (:meth:`Seats.survivors`),
as do those Model Exit sends away; :meth:`Seats.release` then closes their
sessions, again through calls. Seats on *standby* have not started: when the
options never consult the other members, only the leader reads the prompt,
and a standby member joins only if the leader fails (``lineup.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..backends.base import Member, MemberSession
from ..errors import MemberFailedError
from ..types import Departure, DepartureKind
from .calls import COUNTED, Asking, Call, Calls, Method
from .live import LiveCalls, Outlet


@dataclass(eq=False)
class Seat:
    """A member's place in one generation."""

    name: str
    member: Member
    index: int  # position among the generation's members (seeds, tie-breaks)
    session: MemberSession | None = None
    quality: float = 0.0  # cumulative aggregate score of its drafts (Model Exit)
    bpb: float | None = None  # bits per byte of the prompt (prompt-fit prior)
    timings: dict[str, float] = field(default_factory=dict)  # seconds waited per phase, this round


class Seats:
    """The seats of one generation and the bookkeeping of who takes part."""

    def __init__(self, members: Sequence[Member]) -> None:
        self.all = [Seat(m.name, m, i) for i, m in enumerate(members)]
        self.active: list[Seat] = []
        self.standby: list[Seat] = []  # not started: they join only if the answer needs them
        self.departures: list[Departure] = []
        self.round_departures: list[Departure] = []
        self.counters: dict[str, dict[str, int]] = {}  # backend work per member, read at leaving
        self.calls = 0  # counted member calls (drafts, scores, prompt fits)
        self._leaving: list[Seat] = []

    def new_round(self) -> None:
        self.round_departures = []
        for seat in self.active:
            seat.timings = {}

    def ask(
        self,
        seats: Sequence[Seat],
        phase: str,
        method: Method,
        args: Callable[[Seat], tuple[Any, ...]] = lambda seat: (),
        *,
        kwargs: Callable[[Seat], Mapping[str, Any]] = lambda seat: {},
        outlet: Outlet | None = None,
    ) -> Asking:
        """Call ``method`` on each seat's session (on its member while it has none); each result or exception.

        The seconds each seat waited add up under ``seat.timings[phase]``; drafts, scores and prompt fits
        count as the generation's member calls (``calls.COUNTED``). With an `outlet`, the calls' hooks
        may emit events while they run (``live.py``).
        """
        if not seats:
            return []
        calls = [Call(s.member, s.session, method, args(s), kwargs(s)) for s in seats]
        replies = yield Calls(calls) if outlet is None else LiveCalls(calls, outlet)
        for seat, reply in zip(seats, replies):
            seat.timings[phase] = seat.timings.get(phase, 0.0) + reply.seconds
        if method in COUNTED:
            self.calls += len(seats)
        return [reply.value for reply in replies]

    def seated(self, seats: Sequence[Seat], sessions: Sequence[Any]) -> list[tuple[Seat, Exception]]:
        """Give each seat its opened session; the seats whose start failed, with why."""
        failed = []
        for seat, session in zip(seats, sessions):
            if isinstance(session, Exception):
                failed.append((seat, session))
            else:
                seat.session = session
                self.active.append(seat)
        return failed

    def survivors(
        self, seats: Sequence[Seat], outcomes: Sequence[Any], round_no: int, phase: str
    ) -> list[tuple[Seat, Any]]:
        """Drop members whose call raised; return (seat, result) of the others."""
        kept = []
        for seat, outcome in zip(seats, outcomes):
            if isinstance(outcome, Exception):
                self.depart(seat, round_no, "fault", f"{phase} failed: {type(outcome).__name__}: {outcome}")
            else:
                kept.append((seat, outcome))
        return kept

    def depart(self, seat: Seat, round_no: int, kind: DepartureKind, reason: str) -> None:
        """`seat` leaves the query (its session is closed by the next :meth:`release`)."""
        departure = Departure(seat.name, round_no, kind, reason)
        self.departures.append(departure)
        self.round_departures.append(departure)
        if seat in self.active:
            self.active.remove(seat)
            self._leaving.append(seat)
        if not self.active and not self.standby:
            raise MemberFailedError(
                f"no member is left to answer (last: {seat.name}: {reason})",
                "check the members' servers or files and retry",
            )

    def release(self, seats: Sequence[Seat] | None = None) -> Asking:
        """Read the counters of departed seats (or of `seats`) and close their sessions."""
        leaving = [s for s in (self._leaving if seats is None else seats) if s.session is not None]
        self._leaving = [s for s in self._leaving if s not in leaving]
        counters = yield from self.ask(leaving, "leave", "counters")
        for seat, value in zip(leaving, counters):
            if not isinstance(value, Exception):
                self.counters[seat.name] = value
        yield from self.ask(leaving, "leave", "close")  # a broken member's failure is ignored
        for seat in leaving:
            seat.session = None

    def close_all(self) -> None:
        """Close every open session directly: the generation was closed and cannot yield any more."""
        for seat in self.all:
            if seat.session is not None:
                try:
                    seat.session.close()
                except Exception:
                    pass  # a broken member must not stop the others from closing
                seat.session = None
        self.active = []
