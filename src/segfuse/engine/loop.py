"""The SpecFuse loop: draft -> verify -> rank -> broadcast, one segment per round.

A generation is a coroutine (:func:`fusion_steps`): it yields events for the
caller and member calls for its driver (``calls.py``), and is sent the replies.
:func:`fuse` drives one generation; ``scheduler.py`` drives many together.
It is backend-agnostic and free of I/O: members follow ``backends.base``.

Each round runs the phases of ``phases.py`` in order. With a confidence
``gate`` the *leader* (the largest member, or the one named) drafts first and
its draft wins alone when it is confident; otherwise every member drafts, every
member verifies every candidate, and the vote ranks them. The winner is
broadcast to every member and streamed; Model Exit may then send laggards away.

When the options never consult the others (the default: the leader alone,
``accept_margin`` 0), only the leader starts; the others wait on *standby*
(``followers="lazy"``) and one joins, reading the prompt and the answer so far
at once, only if the leader fails mid-answer. The leader's text then goes out
as it decodes it (``live.py``).

A generation reads its :class:`~segfuse.request.FusionRequest` once: what stays the same for all of
it is its ``context.GenerationContext``, handed to the lineup and the phases. Its seats and leader
are in ``lineup.py``, the answer so far in ``transcript.py``, the voting weights and round records
in ``records.py``.

A conversation that ends with an assistant message (a prefill) is continued:
the members read it left open (``prompting.py``) and the answer is what follows
it; stop strings, the constraint and the guard read the prefill and the answer
together (``Transcript.message``).

Members take part while *active* (``seats.py``): a member leaves the query when
Model Exit finds it lagging or when one of its calls raises (a fault: a dead
server, a timeout, garbage); the answer completes with the others and the
departure is recorded. See docs/design.md#the-method for the method, docs/results.md
for the defaults.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from ..backends.base import Member
from ..errors import InvalidRequestError
from ..options import FusionOptions
from ..prompting import prefill_of
from ..request import FusionRequest
from ..types import DoneEvent, Event, Result, RoundEvent
from . import phases
from .calls import CallRunner, Calls, Reply
from .context import GenerationContext, Round
from .drafted import DraftedRounds
from .drafting import Plan
from .lineup import SEED_SPACE, Lineup, member_seed
from .live import Handoff, LiveCalls
from .phases import Drafted, Known
from .records import Decision, Votes, gated_how, round_record
from .seats import Seat
from .transcript import Transcript

log = logging.getLogger("segfuse.engine")

__all__ = ["SEED_SPACE", "Steps", "Stop", "drive", "fuse", "fusion_steps", "member_seed"]

# A generation as a coroutine: it yields events and member calls, is sent the replies to calls.
Steps = Generator[Event | Calls, list[Reply] | None, None]


@dataclass(frozen=True)
class Stop:
    """A round could not produce a candidate: the answer ends, for this reason."""

    reason: str


def fusion_steps(members: Sequence[Member], request: FusionRequest) -> Steps:
    """One fused generation of `request` by `members` as a coroutine: it yields events and member calls.

    A ``Calls`` item asks for work on members; the driver runs it (one by one,
    concurrently, or batched with other generations' calls) and sends back one
    ``Reply`` per call. Any other item is an event; send None after it.
    The request's weights are the initial voting weights by member name (Hedge carried across
    queries); missing members get the mean weight. Its constraint: members that can draft under it
    do, and no candidate that breaks it wins. Its deadline: no round starts after it; the answer so far
    ends with finish reason "deadline" (a length limit). Closing the coroutine closes its member sessions.
    """
    if not members:
        raise InvalidRequestError("no members to fuse", "give at least one model")
    options = request.options
    if options.leader != "auto" and options.leader not in {m.name for m in members}:
        raise InvalidRequestError(
            f"leader {options.leader!r} is not a member", f"members: {', '.join(m.name for m in members)}; or auto"
        )
    if request.constraint is not None and not any(m.capabilities.constrained for m in members):
        raise InvalidRequestError(
            "structured output needs a member that can draft under a constraint: "
            + ", ".join(m.name for m in members)
            + " cannot (remote servers draft freely)",
            "add a llama.cpp or transformers member, or drop response_format",
        )
    _check_drafting(members, options)
    generation = Generation(members, request)
    try:
        yield from generation.run()
    finally:
        generation.seats.close_all()


def _check_drafting(members: Sequence[Member], options: FusionOptions) -> None:
    """Drafts need a leader that reads them in one pass (``MemberSession.speculate``): say so up front."""
    if options.draft == "off":
        return
    readers = [m.name for m in members if m.capabilities.speculates]
    named = options.leader if options.leader != "auto" else None
    if not readers or (named is not None and named not in readers):
        who = named or ", ".join(m.name for m in members)
        raise InvalidRequestError(
            f"draft={options.draft!r} needs a leader that reads drafts in one pass; {who} cannot "
            "(a remote server gives no logits of every position of a text it did not write, a Ray member does "
            "not forward the call)",
            "lead with a llama.cpp or transformers member, or set draft to off",
            field="draft",
        )


def drive(steps: Steps, live: bool = True) -> Iterator[Event]:
    """Run one generation's coroutine to its end, yielding its events (the last is a DoneEvent).

    `live`: the events that calls make while they run (the leader's text as it decodes it) are
    yielded as they come; for that, those calls run on a helper thread."""
    helper: ThreadPoolExecutor | None = None
    with CallRunner() as runner:
        try:
            reply = None
            while True:
                item = steps.send(reply)
                if isinstance(item, LiveCalls) and live:
                    helper = helper or ThreadPoolExecutor(1, thread_name_prefix="segfuse-drive")
                    reply = yield from _run_live(runner, item, helper)
                elif isinstance(item, Calls):
                    reply = runner.run(item.calls)
                else:
                    reply = None
                    yield item
        except StopIteration:
            return
        finally:
            if helper is not None:
                helper.shutdown(wait=True)  # a call still running must end before its sessions close
            steps.close()


def _run_live(runner: CallRunner, item: LiveCalls, helper: ThreadPoolExecutor) -> Generator[Event, None, list[Reply]]:
    """Run `item`'s calls on the helper thread, yielding the events their hooks emit meanwhile; the helper
    waits while each event is consumed (:class:`~segfuse.engine.live.Handoff`), so the two never run at once."""
    handoff = Handoff()
    item.outlet.listen(handoff.give)
    future = helper.submit(runner.run, item.calls)
    future.add_done_callback(lambda _: handoff.end())  # after every event of the calls
    try:
        while (event := handoff.take()) is not None:
            try:
                yield event
            finally:
                handoff.taken()
    finally:
        item.outlet.listen(None)
        handoff.close()
    return future.result()


def fuse(members: Sequence[Member], request: FusionRequest) -> Iterator[Event]:
    """Run one fused generation, yielding events; the last is a DoneEvent."""
    return drive(fusion_steps(members, request))


class Generation:
    """One fused generation: rounds until the answer stops, each decided by ``_round``.

    Its jobs live apart: the seats and who leads (:class:`~segfuse.engine.lineup.Lineup`), the answer so far
    (:class:`~segfuse.engine.transcript.Transcript`), the voting weights and round records (``records.py``).
    """

    def __init__(self, members: Sequence[Member], request: FusionRequest) -> None:
        self.messages = request.messages
        self.context = GenerationContext.of(request)
        self.votes = Votes([m.name for m in members], request.weights)
        self.lineup = Lineup(members, self.context, self.votes.weights)
        self.seats = self.lineup.seats
        self.transcript = Transcript([s.name for s in self.seats.all])
        names = [m.name for m in members]
        self.drafting = DraftedRounds(self.context, request.messages, names) if request.options.draft != "off" else None

    def run(self) -> Steps:
        """Seat the members, run rounds until the answer stops, then report."""
        o, transcript, messages = self.context.options, self.transcript, self.messages
        transcript.started = time.perf_counter()
        transcript.prefill = prefill_of(messages)
        yield from self.lineup.start(messages)
        if o.prior == "prompt":
            prior = yield from phases.prompt_prior(self.seats, self.context, messages)
            self.votes.weights.update(prior or {})
            yield from self.seats.release()
        while True:
            yield from self.lineup.catch_up(transcript.text, transcript.stats.rounds)
            if (reason := self._limit()) is not None:
                break
            round_start = time.perf_counter()
            at = transcript.round(transcript.stats.rounds + 1, o.max_tokens)
            decision = yield from self._round(at)
            if isinstance(decision, Stop):
                reason = decision.reason
                break
            record = round_record(at, decision, self.votes, self.seats.calls)
            if self.drafting is not None:
                record.drafts = self.drafting.learned(decision, at)
            chosen = decision.winner.candidate
            yield from transcript.append(record, self.seats.calls)
            yield from phases.broadcast(self.seats, at, chosen.text)
            if o.exit and not chosen.finished and not decision.gated:
                keep = self.lineup.leader() if o.gate is not None else None
                phases.model_exit(self.seats, self.context, at, keep)
            yield from self.seats.release()
            record.departures = list(self.seats.round_departures)
            record.total_s = time.perf_counter() - round_start
            transcript.rounds.append(record)
            yield RoundEvent(record)
            if chosen.finished:
                reason = "stop"
                break
        yield from self._finish(reason)

    def _limit(self) -> str | None:
        """Why no further round can run (the budget is spent, the deadline passed, a context window is
        full), or None."""
        o, active = self.context.options, self.seats.active
        if o.max_tokens - self.transcript.stats.tokens <= 0:
            return "length"
        if self.context.passed_deadline():
            return "deadline"
        if min(s.session.room for s in active if s.session) < len(active) * o.window + 1:
            return "context"
        return None

    def _round(self, at: Round) -> Generator[Calls, list[Reply], Decision | Stop]:
        """Gate, draft, consult, verify, rank: how the round's winner (not yet broadcast) was chosen."""
        o, seats, context = self.context.options, self.seats, self.context
        seats.new_round()
        leader = self.lineup.leader() if o.gate is not None and len(seats.active) + len(seats.standby) > 1 else None
        solo = leader is not None and o.accept_margin == 0  # the leader accepts nothing: it answers alone
        live = (
            self.transcript.stream(leader.name, at.no, phases.stops(leader, context))
            if leader is not None and solo and self.lineup.answers_alone()
            else None
        )
        early: Drafted = []
        decided = partial(Decision, leader=leader, confidence=None, calls_before=seats.calls)
        reader = leader if solo else (seats.active[0] if len(seats.active) == 1 and not seats.standby else None)
        if self.drafting is not None and reader is not None and reader.member.capabilities.speculates:
            plan, copied = self.drafting.plan(seats, reader, at)  # (the one member reads drafts too: lookup)
            if plan.drafting:
                return (yield from self._drafted(at, reader, plan, copied, decided))
        if leader is not None:
            early = yield from phases.draft(seats, context, [leader], min(o.window, at.budget), at, live)
            if not seats.active:  # the leader failed and the others are on standby: one takes over
                return (yield from self._take_over(at))
            if early:
                check = phases.gate(early[0][1], context, at, patient=self.votes.hopeless < o.guard_patience)
                decided = partial(decided, confidence=check.confidence)
                if check.passes or (solo and early[0][1].eligible):
                    how = gated_how(check.confidence, context)
                    return decided(how=how, drafted=early, ranking=phases.alone(early, leader))
        solo = solo and leader in seats.active
        drafted = yield from phases.draft_all(seats, context, at, early, only=leader if solo else None, live=live)
        if not seats.active:
            return (yield from self._take_over(at))
        if not drafted:
            return Stop("length")
        if solo and leader is not None:  # (solo implies a leader)
            how = gated_how(decided.keywords["confidence"], context)
            return decided(how=how, drafted=drafted, ranking=phases.alone(drafted, leader))
        return (yield from self._vote(at, drafted, decided))

    def _drafted(
        self, at: Round, leader: Seat, plan: Plan, copied: str, decided: partial[Decision]
    ) -> Generator[Calls, list[Reply], Decision | Stop]:
        """The leader reads the planned drafters' drafts (``drafted.py``); if its call fails, the round runs
        again under the next leader."""
        assert self.drafting is not None
        drafted = yield from self.drafting.round(self.seats, leader, at, plan, copied)
        if leader not in self.seats.active:
            if not self.seats.active:
                return (yield from self._take_over(at))
            return (yield from self._round(at))
        if not drafted or not drafted[0][1].eligible:
            return Stop("length")
        return decided(how="drafted", drafted=drafted, ranking=phases.alone(drafted, leader))

    def _vote(
        self, at: Round, drafted: Drafted, decided: partial[Decision]
    ) -> Generator[Calls, list[Reply], Decision | Stop]:
        """The leader consults the others' proposals (when it may accept one), then every member verifies
        and the vote ranks the candidates. `decided` makes the decision from what the round knew before."""
        o, seats, context = self.context.options, self.seats, self.context
        leader: Seat | None = decided.keywords["leader"]
        consulted: dict[str, str] = {}
        known: Known = {}
        if leader is not None and o.accept_margin is not None and any(s is leader and d.eligible for s, d in drafted):
            drafted, scores, verdicts = yield from phases.consult(seats, context, at, leader, drafted)
            consulted, known = {name: v.reason for name, v in verdicts.items()}, {leader.name: scores}
            if leader in seats.active and not any(v.accepted for v in verdicts.values()):
                ranking = phases.alone(drafted, leader)
                return decided(how="rejected", drafted=drafted, ranking=ranking, consulted=consulted)
        drafted, known = yield from phases.verify(seats, at, drafted, known)
        if not any(d.eligible for _, d in drafted):
            return Stop("length")
        weights = self.votes.normalised([seat.name for seat, _ in drafted])
        ranking = phases.rank([d for _, d in drafted], known, weights, context, at)
        self.votes.learn(drafted, ranking, context)
        return decided(how="vote", drafted=drafted, ranking=ranking, consulted=consulted)

    def _take_over(self, at: Round) -> Generator[Calls, list[Reply], Decision | Stop]:
        """The leader failed mid-round with the others on standby: one catches up and the round runs again
        (from the answer as it now stands: what the leader streamed stays in it)."""
        self.transcript.keep_streamed(at.no)
        yield from self.lineup.catch_up(self.transcript.text, self.transcript.stats.rounds)
        return (yield from self._round(self.transcript.round(at.no, self.context.options.max_tokens)))

    def _finish(self, reason: str) -> Steps:
        transcript, stats = self.transcript, self.transcript.stats
        stats.finish_reason = reason
        stats.total_s = time.perf_counter() - transcript.started
        stats.model_calls = self.seats.calls
        if self.drafting is not None:
            stats.drafting, stats.crowded_rounds = self.drafting.tally, self.drafting.crowded_rounds
        yield from self.seats.release(self.seats.active)
        seats = self.seats.all
        constraint = self.context.constraint
        invalid = constraint.check(transcript.message) if constraint is not None and reason == "stop" else None
        yield DoneEvent(
            Result(
                valid=None if constraint is None or reason != "stop" else invalid is None,
                invalid_reason=invalid,
                text=transcript.text,
                segments=transcript.segments,
                rounds=transcript.rounds,
                stats=stats,
                models=[s.name for s in seats],
                departures=self.seats.departures,
                weights=dict(self.votes.weights),
                counters=dict(self.seats.counters),
                prompt_bpb={s.name: s.bpb for s in seats if s.bpb is not None},
            )
        )
