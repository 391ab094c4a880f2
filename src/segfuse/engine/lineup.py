"""A generation's members in their seats: who starts, who leads, who takes over.

When the options never consult the others (the leader alone), only the leader
opens a session; the others wait on standby, and the next leader joins,
reading the prompt and the answer so far at once, only if the leader fails.
Otherwise every member opens one. A member that cannot start leaves the query.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..backends.base import Member
from ..errors import InvalidRequestError, MemberFailedError
from ..types import Departure, Message
from .calls import Asking
from .context import GenerationContext
from .seats import Seat, Seats
from .selection import pick_leader

SEED_SPACE = 2**63  # member seeds lie in [0, 2**63): NumPy, torch and remote servers all take them


def member_seed(seed: int | None, index: int) -> int | None:
    """A distinct, reproducible seed per member (two copies of a model differ); None: random.

    Any integer the options accept maps into ``SEED_SPACE`` (small seeds unchanged)."""
    return None if seed is None else (seed * 7919 + index) % SEED_SPACE


class Lineup:
    """The seats of one generation and the choice of its leader.

    `weights` is the generation's voting weights (read, never written here): the
    leader is the largest member, or the heaviest voter where sizes are unknown.
    """

    def __init__(self, members: Sequence[Member], context: GenerationContext, weights: Mapping[str, float]) -> None:
        self.seats = Seats(members)
        self.context = context
        self.options = context.options
        self.weights = weights
        self.lead: str | None = None  # the gate's leader, fixed at its first round
        self.messages: list[Message] = []

    def answers_alone(self) -> bool:
        """Whether the options never consult the members besides the leader (the leader alone)."""
        o = self.options
        return o.gate is not None and o.accept_margin == 0 and o.prior != "prompt" and len(self.seats.all) > 1

    def start(self, messages: Sequence[Message]) -> Asking:
        """Every member opens a session (with lazy followers, the leader alone); one that cannot leaves."""
        seats = self.seats
        self.messages = list(messages)
        # Members that draft for the leader start with it; otherwise lazy followers wait on standby.
        drafting_members = self.options.draft in ("members", "auto")
        if self.options.followers == "lazy" and self.answers_alone() and not drafting_members:
            first = self.successor(seats.all)
            seats.standby = [s for s in seats.all if s is not first]
            yield from self.open([first], 0)
            yield from self.catch_up("", 0)
        else:
            yield from self.open(seats.all, 0)

    def open(self, chosen: Sequence[Seat], round_no: int) -> Asking:
        """The chosen members open sessions; a member that cannot leaves the query."""
        o, seats = self.options, self.seats
        reserve = len(seats.all) * o.window + 1
        given = self.context.start_options
        opened = yield from seats.ask(
            chosen,
            "start",
            "start",
            lambda s: (self.messages,),
            kwargs=lambda s: {"seed": member_seed(o.seed, s.index), "reserve": reserve, **given},
        )
        failed = seats.seated(chosen, opened)
        for _, exc in failed:
            if isinstance(exc, InvalidRequestError):
                raise exc  # the request itself is wrong (e.g. too long): no member could answer it
        for seat, exc in failed:
            reason = f"start failed: {type(exc).__name__}: {exc}"
            seats.departures.append(Departure(seat.name, round_no, "fault", reason))
        if (constraint := self.context.constraint) is not None:
            able = [s for s in chosen if s in seats.active and s.member.capabilities.constrained]
            outcome = yield from seats.ask(able, "start", "constrain", lambda s: (constraint,))
            seats.survivors(able, outcome, round_no, "constrain")
        if not seats.active and not seats.standby:
            raise MemberFailedError(
                "no member could start: " + "; ".join(d.reason for d in seats.departures),
                "check the members' servers or files and retry",
            )

    def catch_up(self, text: str, round_no: int) -> Asking:
        """With no started member left, a standby member (the next leader) starts and reads the prompt
        and the answer so far (`text`), in one prefill at its next call; until one is active."""
        seats = self.seats
        while not seats.active and seats.standby:
            seat = self.successor(seats.standby)
            seats.standby.remove(seat)
            yield from self.open([seat], round_no)
            if seat in seats.active and text:
                outcome = yield from seats.ask([seat], "catch up", "accept", lambda s: (text,))
                seats.survivors([seat], outcome, round_no, "catch up")

    def leader(self) -> Seat | None:
        """The member that drafts first under the gate.

        The named one; with ``leader="auto"`` the largest member when every
        active member states its parameter count, else the heaviest voter.
        Chosen once per query (votes must not promote a member to leader); if
        it departs, the next is chosen the same way among those left.
        """
        active = self.seats.active
        seat = next((s for s in active if s.name == self.lead), None)
        if seat is None and active:
            seat = self.successor(active)
            self.lead = seat.name
        return seat

    def successor(self, seats: Sequence[Seat]) -> Seat:
        """Who of `seats` leads: the named leader before any was chosen, else the largest; under a
        constraint, one of those that can draft under it."""
        seats = [s for s in seats if self.context.drafts(s.member)] or seats
        if self.lead is None:
            named = next((s for s in seats if s.name == self.options.leader), None)
            if named is not None:
                return named
        sizes = [n for s in seats if isinstance(n := s.member.n_params, int) and n > 0]
        known = len(sizes) == len(seats)
        return seats[pick_leader(sizes if known else [self.weights[s.name] for s in seats])]
