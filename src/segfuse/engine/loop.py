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

A generation's seats and leader are in ``lineup.py``, the answer so far in
``transcript.py``, the voting weights and round records in ``records.py``.

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
from collections.abc import Generator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..backends.base import Member
from ..constraints import Constraint, TextMatcher
from ..errors import InvalidRequestError
from ..options import FusionOptions
from ..prompting import prefill_of
from ..types import Candidate, DoneEvent, Event, Message, Result, RoundEvent
from . import phases
from .calls import CallRunner, Calls, Reply
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


def fusion_steps(members: Sequence[Member], messages: Sequence[Message], options: FusionOptions, *,
                 weights: Mapping[str, float] | None = None, constraint: Constraint | None = None,
                 top_logprobs: int = 0, deadline: float | None = None, cache_salt: str | None = None) -> Steps:
    """One fused generation as a coroutine: it yields events and member calls.

    A ``Calls`` item asks for work on members; the driver runs it (one by one,
    concurrently, or batched with other generations' calls) and sends back one
    ``Reply`` per call. Any other item is an event; send None after it.
    `weights` are initial voting weights by member name (Hedge carried across
    queries); missing members get the mean weight. `constraint`: what the answer must be
    (structured output); members that can draft under it do, and no candidate that breaks it
    wins. `top_logprobs`: how many of its most likely tokens each drafter reports per position
    (``Segment.trail``). `deadline`: a ``time.monotonic()`` time after which no round starts; the
    answer so far ends with finish reason "deadline" (a length limit). `cache_salt`: members start
    only from prompt prefixes cached under the same salt (and keep theirs under it). Closing the
    coroutine closes its member sessions.
    """
    if not members:
        raise InvalidRequestError("no members to fuse", "give at least one model")
    if options.leader != "auto" and options.leader not in {m.name for m in members}:
        raise InvalidRequestError(f"leader {options.leader!r} is not a member",
                                  f"members: {', '.join(m.name for m in members)}; or auto")
    if constraint is not None and not any(m.capabilities.constrained for m in members):
        raise InvalidRequestError(
            "structured output needs a member that can draft under a constraint: "
            + ", ".join(m.name for m in members) + " cannot (remote servers draft freely)",
            "add a llama.cpp or transformers member, or drop response_format")
    if constraint is not None:
        constraint.check_prefill(prefill_of(messages))
    generation = Generation(members, options, weights, constraint, top_logprobs, deadline, cache_salt)
    try:
        yield from generation.run(messages)
    finally:
        generation.seats.close_all()


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


def fuse(members: Sequence[Member], messages: Sequence[Message], options: FusionOptions, *,
         weights: Mapping[str, float] | None = None, constraint: Constraint | None = None,
         top_logprobs: int = 0) -> Iterator[Event]:
    """Run one fused generation, yielding events; the last is a DoneEvent."""
    return drive(fusion_steps(members, messages, options, weights=weights, constraint=constraint,
                              top_logprobs=top_logprobs))


class Generation:
    """One fused generation: rounds until the answer stops, each decided by ``_round``.

    Its jobs live apart: the seats and who leads (:class:`~segfuse.engine.lineup.Lineup`), the answer so far
    (:class:`~segfuse.engine.transcript.Transcript`), the voting weights and round records (``records.py``).
    """

    def __init__(self, members: Sequence[Member], options: FusionOptions,
                 weights: Mapping[str, float] | None, constraint: Constraint | None = None,
                 top_logprobs: int = 0, deadline: float | None = None, cache_salt: str | None = None) -> None:
        self.options = options
        self.deadline = deadline
        self.sampling = replace(options.sampling, top_logprobs=top_logprobs)
        self.constraint = constraint
        self.matcher = TextMatcher(constraint) if constraint is not None else None
        self.votes = Votes([m.name for m in members], weights)
        self.lineup = Lineup(members, options, constraint, cache_salt, self.votes.weights)
        self.seats = self.lineup.seats
        self.answer = Transcript([s.name for s in self.seats.all])

    def run(self, messages: Sequence[Message]) -> Steps:
        """Seat the members, run rounds until the answer stops, then report."""
        o, answer = self.options, self.answer
        answer.started = time.perf_counter()
        answer.prefill = prefill_of(messages)
        yield from self.lineup.start(messages)
        if o.prior == "prompt":
            prior = yield from phases.prompt_prior(self.seats, messages, o.prior_temperature)
            self.votes.weights.update(prior or {})
            yield from self.seats.release()
        while True:
            yield from self.lineup.catch_up(answer.text, answer.stats.rounds)
            if (reason := self._limit()) is not None:
                break
            round_no = answer.stats.rounds + 1
            round_start = time.perf_counter()
            decision = yield from self._round(round_no)
            if isinstance(decision, Stop):
                reason = decision.reason
                break
            record = round_record(round_no, decision, self.votes, self.seats.calls)
            chosen = decision.winner.candidate
            yield from answer.append(record, self.seats.calls)
            yield from phases.broadcast(self.seats, chosen.text, round_no)
            if o.exit and not chosen.finished and not decision.gated:
                phases.model_exit(self.seats, o, round_no, self.lineup.leader() if o.gate is not None else None)
            yield from self.seats.release()
            record.departures = list(self.seats.round_departures)
            record.total_s = time.perf_counter() - round_start
            answer.rounds.append(record)
            yield RoundEvent(record)
            if chosen.finished:
                reason = "stop"
                break
        yield from self._finish(reason)

    def _limit(self) -> str | None:
        """Why no further round can run (the budget is spent, the deadline passed, a context window is
        full), or None."""
        o, active = self.options, self.seats.active
        if o.max_tokens - self.answer.stats.tokens <= 0:
            return "length"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "deadline"
        if min(s.session.room for s in active if s.session) < len(active) * o.window + 1:
            return "context"
        return None

    def _round(self, round_no: int) -> Generator[Calls, list[Reply], Decision | Stop]:
        """Gate, draft, consult, verify, rank: how the round's winner (not yet broadcast) was chosen."""
        o, seats, text = self.options, self.seats, self.answer.message
        seats.new_round()
        calls_before = seats.calls
        budget = o.max_tokens - self.answer.stats.tokens
        n = min(o.window, budget)
        leader = self.lineup.leader() if o.gate is not None and len(seats.active) + len(seats.standby) > 1 else None
        solo = leader is not None and o.accept_margin == 0  # the leader accepts nothing: it answers alone
        live = (self.answer.stream(leader.name, round_no, phases.stops(leader, o))  # type: ignore[union-attr]
                if solo and self.lineup.answers_alone() else None)
        early: Drafted = []
        confidence: float | None = None
        if leader is not None:
            early = yield from phases.draft(seats, [leader], n, text, o, round_no, self._check, self.sampling, live)
            if not seats.active:  # the leader failed and the others are on standby: one takes over
                return (yield from self._take_over(round_no))
            if early:
                check = phases.gate(early[0][1], o, answer=text, last=self.answer.last,
                                    patient=self.votes.hopeless < o.guard_patience)
                confidence = check.confidence
                if check.passes or (solo and early[0][1].eligible):
                    return Decision(gated_how(confidence, o), early, phases.alone(early, leader), leader,
                                    confidence, calls_before)
        solo = solo and leader in seats.active
        drafted = yield from phases.draft_all(seats, early, n, budget, text, o, round_no,
                                              only=leader if solo else None, check=self._check,
                                              drafting=self.lineup.drafts, sampling=self.sampling, live=live)
        if not seats.active:
            return (yield from self._take_over(round_no))
        if not drafted:
            return Stop("length")
        if solo:
            return Decision(gated_how(confidence, o), drafted, phases.alone(drafted, leader),  # type: ignore[arg-type]
                            leader, confidence, calls_before)
        return (yield from self._vote(round_no, drafted, leader, confidence, calls_before))

    def _vote(self, round_no: int, drafted: Drafted, leader: Seat | None, confidence: float | None,
              calls_before: int) -> Generator[Calls, list[Reply], Decision | Stop]:
        """The leader consults the others' proposals (when it may accept one), then every member verifies
        and the vote ranks the candidates."""
        o, seats = self.options, self.seats
        consulted: dict[str, str] = {}
        known: Known = {}
        if leader is not None and o.accept_margin is not None and any(s is leader and d.eligible for s, d in drafted):
            drafted, scores, verdicts = yield from phases.consult(seats, leader, drafted, o, round_no)
            consulted, known = {name: v.reason for name, v in verdicts.items()}, {leader.name: scores}
            if leader in seats.active and not any(v.accepted for v in verdicts.values()):
                return Decision("rejected", drafted, phases.alone(drafted, leader), leader, confidence, calls_before,
                                consulted)
        drafted, known = yield from phases.verify(seats, drafted, round_no, known)
        if not any(d.eligible for _, d in drafted):
            return Stop("length")
        weights = self.votes.normalised([seat.name for seat, _ in drafted])
        ranking = phases.rank([d for _, d in drafted], known, weights, o, round_no=round_no,
                              answer=self.answer.message, last=self.answer.last)
        self.votes.learn(drafted, ranking, o)
        return Decision("vote", drafted, ranking, leader, confidence, calls_before, consulted)

    def _check(self, answer: str, candidate: Candidate) -> str | None:
        """Why `candidate` may not win under the request's constraint (None: it may, or there is none)."""
        if self.matcher is None:
            return None
        if not self.matcher.allows(answer, candidate.text):
            return "breaks the constraint"
        if candidate.finished and not self.matcher.complete(answer + candidate.text):
            return "ends an incomplete answer"
        return None

    def _take_over(self, round_no: int) -> Generator[Calls, list[Reply], Decision | Stop]:
        """The leader failed mid-round with the others on standby: one catches up and the round runs again."""
        self.answer.keep_streamed(round_no)
        yield from self.lineup.catch_up(self.answer.text, self.answer.stats.rounds)
        return (yield from self._round(round_no))

    def _finish(self, reason: str) -> Steps:
        answer, stats = self.answer, self.answer.stats
        stats.finish_reason = reason
        stats.total_s = time.perf_counter() - answer.started
        stats.model_calls = self.seats.calls
        yield from self.seats.release(self.seats.active)
        seats = self.seats.all
        invalid = self.constraint.check(answer.message) if self.constraint is not None and reason == "stop" else None
        yield DoneEvent(Result(
            valid=None if self.constraint is None or reason != "stop" else invalid is None, invalid_reason=invalid,
            text=answer.text, segments=answer.segments, rounds=answer.rounds, stats=stats,
            models=[s.name for s in seats], departures=self.seats.departures, weights=dict(self.votes.weights),
            counters=dict(self.seats.counters), prompt_bpb={s.name: s.bpb for s in seats if s.bpb is not None},
        ))
