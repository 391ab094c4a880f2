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
at once, only if the leader fails mid-answer.

Members take part while *active* (``seats.py``): a member leaves the query when
Model Exit finds it lagging or when one of its calls raises (a fault: a dead
server, a timeout, garbage); the answer completes with the others and the
departure is recorded. See docs/design.md#the-method for the method, docs/results.md
for the defaults.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from . import phases
from .backends.base import Member
from .calls import CallRunner, Calls, Reply
from .constraints import Constraint, TextMatcher
from .errors import InvalidRequestError, MemberFailedError
from .live import LeaderStream, LiveCalls
from .options import FusionOptions
from .phases import Drafted, Known, Ranking
from .seats import Seat, Seats
from .selection import pick_leader
from .types import Candidate, Departure, DoneEvent, Event, Message, Result, RoundEvent, RoundRecord, Segment, SegmentEvent, Stats

log = logging.getLogger("specfuse.engine")

# A generation as a coroutine: it yields events and member calls, is sent the replies to calls.
Steps = Generator[Event | Calls, list[Reply] | None, None]


@dataclass(frozen=True)
class Stop:
    """A round could not produce a candidate: the answer ends, for this reason."""

    reason: str


SEED_SPACE = 2**63  # member seeds lie in [0, 2**63): NumPy, torch and remote servers all take them


def member_seed(seed: int | None, index: int) -> int | None:
    """A distinct, reproducible seed per member (two copies of a model differ); None: random.

    Any integer the options accept maps into ``SEED_SPACE`` (small seeds unchanged)."""
    return None if seed is None else (seed * 7919 + index) % SEED_SPACE


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
                    helper = helper or ThreadPoolExecutor(1, thread_name_prefix="specfuse-drive")
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
    """Run `item`'s calls on the helper thread, yielding the events their hooks emit meanwhile."""
    events: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
    item.outlet.listen(events.put)
    future = helper.submit(runner.run, item.calls)
    future.add_done_callback(lambda _: events.put(None))  # after every event of the calls
    try:
        while (event := events.get()) is not None:
            yield event
    finally:
        item.outlet.listen(None)
    return future.result()


def fuse(members: Sequence[Member], messages: Sequence[Message], options: FusionOptions, *,
         weights: Mapping[str, float] | None = None, constraint: Constraint | None = None,
         top_logprobs: int = 0) -> Iterator[Event]:
    """Run one fused generation, yielding events; the last is a DoneEvent."""
    return drive(fusion_steps(members, messages, options, weights=weights, constraint=constraint,
                              top_logprobs=top_logprobs))


class Generation:
    """State of one fused generation: seats, voting weights, statistics, the answer so far."""

    def __init__(self, members: Sequence[Member], options: FusionOptions,
                 weights: Mapping[str, float] | None, constraint: Constraint | None = None,
                 top_logprobs: int = 0, deadline: float | None = None, cache_salt: str | None = None) -> None:
        self.options = options
        self.deadline = deadline
        # Given to members only when set: a member's start() need not know about salts otherwise.
        self.start_options = {} if cache_salt is None else {"cache_salt": cache_salt}
        self.sampling = replace(options.sampling, top_logprobs=top_logprobs)
        self.constraint = constraint
        self.matcher = TextMatcher(constraint) if constraint is not None else None
        self.seats = Seats(members)
        start = dict(weights or {})
        mean = sum(start.values()) / len(start) if start else 1.0 / len(members)
        self.weights = {s.name: start.get(s.name, mean) for s in self.seats.all}
        self.stats = Stats(wins={s.name: 0 for s in self.seats.all})
        self.lead: str | None = None  # the gate's leader, fixed at its first round
        self.hopeless = 0  # votes in a row whose winner still looped (guard patience)
        self.text = ""
        self.messages: list[Message] = []
        self.segments: list[Segment] = []
        self.rounds: list[RoundRecord] = []
        self.live: LeaderStream | None = None  # this round's, when the leader answers alone
        self.started = time.perf_counter()

    def run(self, messages: Sequence[Message]) -> Steps:
        """Seat the members, run rounds until the answer stops, then report."""
        o = self.options
        self.started = time.perf_counter()
        self.messages = list(messages)
        yield from self._start(messages)
        if o.prior == "prompt":
            prior = yield from phases.prompt_prior(self.seats, messages, o.prior_temperature)
            self.weights.update(prior or {})
            yield from self.seats.release()
        while True:
            yield from self._catch_up()
            if (reason := self._limit()) is not None:
                break
            round_no = self.stats.rounds + 1
            round_start = time.perf_counter()
            record = yield from self._round(round_no)
            if isinstance(record, Stop):
                reason = record.reason
                break
            chosen = record.candidates[record.winner_index]
            yield from self._append(record)
            yield from phases.broadcast(self.seats, chosen.text, round_no)
            if o.exit and not chosen.finished and not record.gated:
                phases.model_exit(self.seats, o, round_no, self._leader() if o.gate is not None else None)
            yield from self.seats.release()
            record.departures = list(self.seats.round_departures)
            record.total_s = time.perf_counter() - round_start
            self.rounds.append(record)
            yield RoundEvent(record)
            if chosen.finished:
                reason = "stop"
                break
        yield from self._finish(reason)

    def _start(self, messages: Sequence[Message]) -> Generator[Calls, list[Reply], None]:
        """Every member opens a session (with lazy followers, the leader alone); one that cannot leaves."""
        seats = self.seats
        if self.options.followers == "lazy" and self._answers_alone():
            first = self._successor(seats.all)
            seats.standby = [s for s in seats.all if s is not first]
            yield from self._open([first], messages, 0)
            yield from self._catch_up()
        else:
            yield from self._open(seats.all, messages, 0)

    def _answers_alone(self) -> bool:
        """Whether the options never consult the members besides the leader (the leader alone)."""
        o = self.options
        return o.gate is not None and o.accept_margin == 0 and o.prior != "prompt" and len(self.seats.all) > 1

    def _open(self, chosen: Sequence[Seat], messages: Sequence[Message], round_no: int) -> Generator[Calls, list[Reply], None]:
        """The chosen members open sessions; a member that cannot leaves the query."""
        o, seats = self.options, self.seats
        reserve = len(seats.all) * o.window + 1
        opened = yield from seats.ask(chosen, "start", "start", lambda s: (messages,), counted=False,
                                      kwargs=lambda s: {"seed": member_seed(o.seed, s.index), "reserve": reserve,
                                                        **self.start_options})
        failed = seats.seated(chosen, opened)
        for _, exc in failed:
            if isinstance(exc, InvalidRequestError):
                raise exc  # the request itself is wrong (e.g. too long): no member could answer it
        for seat, exc in failed:
            reason = f"start failed: {type(exc).__name__}: {exc}"
            seats.departures.append(Departure(seat.name, round_no, "fault", reason))
        if self.constraint is not None:
            able = [s for s in chosen if s in seats.active and s.member.capabilities.constrained]
            outcome = yield from seats.ask(able, "start", "constrain", lambda s: (self.constraint,), counted=False)
            seats.survivors(able, outcome, round_no, "constrain")
        if not seats.active and not seats.standby:
            raise MemberFailedError("no member could start: " + "; ".join(d.reason for d in seats.departures),
                                    "check the members' servers or files and retry")

    def _catch_up(self) -> Generator[Calls, list[Reply], None]:
        """With no started member left, a standby member (the next leader) starts and reads the prompt
        and the answer so far, in one prefill at its next call; until one is active."""
        seats = self.seats
        while not seats.active and seats.standby:
            seat = self._successor(seats.standby)
            seats.standby.remove(seat)
            yield from self._open([seat], self.messages, self.stats.rounds)
            if seat in seats.active and self.text:
                outcome = yield from seats.ask([seat], "catch up", "accept", lambda s: (self.text,), counted=False)
                seats.survivors([seat], outcome, self.stats.rounds, "catch up")

    def _limit(self) -> str | None:
        """Why no further round can run (the budget is spent, the deadline passed, a context window is
        full), or None."""
        o, active = self.options, self.seats.active
        if o.max_tokens - self.stats.tokens <= 0:
            return "length"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "deadline"
        if min(s.session.room for s in active if s.session) < len(active) * o.window + 1:
            return "context"
        return None

    def _round(self, round_no: int) -> Generator[Calls, list[Reply], RoundRecord | Stop]:
        """Gate, draft, consult, verify, rank: the round's winner (not yet broadcast)."""
        o, seats = self.options, self.seats
        seats.new_round()
        calls_before = seats.calls
        budget = o.max_tokens - self.stats.tokens
        n = min(o.window, budget)
        last = self.segments[-1].text if self.segments else ""
        leader = self._leader() if o.gate is not None and len(seats.active) + len(seats.standby) > 1 else None
        solo = leader is not None and o.accept_margin == 0  # the leader accepts nothing: it answers alone
        live = self.live = self._stream(leader, round_no) if solo and self._answers_alone() else None
        early: Drafted = []
        confidence: float | None = None
        if leader is not None:
            early = yield from phases.draft(seats, [leader], n, self.text, o, round_no, self._check, self.sampling,
                                            live)
            if not seats.active:  # the leader failed and the others are on standby: one takes over
                return (yield from self._take_over(round_no))
            if early:
                check = phases.gate(early[0][1], o, answer=self.text, last=last,
                                    patient=self.hopeless < o.guard_patience)
                confidence = check.confidence
                if check.passes or (solo and early[0][1].eligible):
                    return self._record(round_no, early, phases.alone(early, leader), calls_before, leader,
                                        confidence, gated=True)
        solo = solo and leader in seats.active
        drafted = yield from phases.draft_all(seats, early, n, budget, self.text, o, round_no,
                                              only=leader if solo else None, check=self._check,
                                              drafting=self._drafts, sampling=self.sampling, live=live)
        if not seats.active:
            return (yield from self._take_over(round_no))
        if not drafted:
            return Stop("length")
        if solo:
            return self._record(round_no, drafted, phases.alone(drafted, leader), calls_before, leader,  # type: ignore[arg-type]
                                confidence, gated=True)
        consulted: dict[str, str] = {}
        known: Known = {}
        if leader is not None and o.accept_margin is not None and any(s is leader and d.eligible for s, d in drafted):
            drafted, scores, verdicts = yield from phases.consult(seats, leader, drafted, o, round_no)
            consulted, known = {name: v.reason for name, v in verdicts.items()}, {leader.name: scores}
            if leader in seats.active and not any(v.accepted for v in verdicts.values()):
                return self._record(round_no, drafted, phases.alone(drafted, leader), calls_before, leader,
                                    confidence, consulted=consulted)
        drafted, known = yield from phases.verify(seats, drafted, round_no, known)
        if not any(d.eligible for _, d in drafted):
            return Stop("length")
        weights = self._voting_weights([seat.name for seat, _ in drafted])
        ranking = phases.rank([d for _, d in drafted], known, weights, o, round_no=round_no, answer=self.text,
                              last=last)
        self._learn(drafted, ranking)
        return self._record(round_no, drafted, ranking, calls_before, leader, confidence, consulted=consulted)

    def _drafts(self, seat: Seat) -> bool:
        """Whether `seat` drafts: under a constraint, only members that can draft under it (the others verify)."""
        return self.constraint is None or seat.member.capabilities.constrained

    def _check(self, answer: str, candidate: Candidate) -> str | None:
        """Why `candidate` may not win under the request's constraint (None: it may, or there is none)."""
        if self.matcher is None:
            return None
        if not self.matcher.allows(answer, candidate.text):
            return "breaks the constraint"
        if candidate.finished and not self.matcher.complete(answer + candidate.text):
            return "ends an incomplete answer"
        return None

    def _stream(self, leader: Seat, round_no: int) -> LeaderStream:
        """The round's segment as the leader writes it (it answers alone)."""
        return LeaderStream(leader.name, round_no, self.text, phases.stops(leader, self.options))

    def _keep_streamed(self, round_no: int) -> None:
        """What went out of a leader that then failed stays in the answer: its successor goes on from it."""
        live, self.live = self.live, None
        if live is not None and live.sent:
            self.text += live.sent
            self.segments.append(Segment(text=live.sent, model=live.model, round=round_no))

    def _take_over(self, round_no: int) -> Generator[Calls, list[Reply], RoundRecord | Stop]:
        """The leader failed mid-round with the others on standby: one catches up and the round runs again."""
        self._keep_streamed(round_no)
        yield from self._catch_up()
        return (yield from self._round(round_no))

    def _leader(self) -> Seat | None:
        """The member that drafts first under the gate.

        The named one; with ``leader="auto"`` the largest member when every
        active member states its parameter count, else the heaviest voter.
        Chosen once per query (votes must not promote a member to leader); if
        it departs, the next is chosen the same way among those left.
        """
        active = self.seats.active
        seat = next((s for s in active if s.name == self.lead), None)
        if seat is None and active:
            seat = self._successor(active)
            self.lead = seat.name
        return seat

    def _successor(self, seats: Sequence[Seat]) -> Seat:
        """Who of `seats` leads: the named leader before any was chosen, else the largest; under a
        constraint, one of those that can draft under it."""
        seats = [s for s in seats if self._drafts(s)] or seats
        if self.lead is None:
            named = next((s for s in seats if s.name == self.options.leader), None)
            if named is not None:
                return named
        sizes = [s.member.n_params for s in seats]
        known = all(isinstance(n, int) and n > 0 for n in sizes)
        return seats[pick_leader(sizes if known else [self.weights[s.name] for s in seats])]  # type: ignore[arg-type]

    def _voting_weights(self, names: Sequence[str]) -> list[float]:
        values = [self.weights[n] for n in names]
        total = sum(values)
        return [v / total for v in values] if total > 0 else [1.0 / len(names)] * len(names)

    def _learn(self, drafted: Drafted, ranking: Ranking) -> None:
        """What a vote teaches: Hedge's weights, the guard's patience, Model Exit's quality."""
        if self.options.hedge:
            self.weights.update(zip([seat.name for seat, _ in drafted], ranking.weights))
        self.hopeless = self.hopeless + 1 if ranking.stuck else 0
        for (seat, _), gain in zip(drafted, phases.quality_gains(ranking, self.options)):
            seat.quality += gain

    def _record(self, round_no: int, drafted: Drafted, ranking: Ranking, calls_before: int, leader: Seat | None,
                confidence: float | None, gated: bool = False, consulted: dict[str, str] | None = None) -> RoundRecord:
        names = [seat.name for seat, _ in drafted]
        o = self.options
        confident = gated and confidence is not None and o.gate is not None and confidence >= o.gate
        decision = "confident" if confident else "alone" if gated else "vote" if ranking.raw else "rejected"
        return RoundRecord(
            index=round_no, active=names, candidates=[d.candidate for _, d in drafted],
            raw_scores=ranking.raw, scores=ranking.scores,
            weights=dict(zip(names, self._voting_weights(names) if decision == "rejected" else ranking.weights)),
            aggregate=ranking.totals, winner_index=ranking.winner, model_calls=self.seats.calls - calls_before,
            gated=gated, leader=leader.name if leader is not None else None, confidence=confidence,
            penalised=ranking.penalised, draft_s={s.name: s.timings.get("draft", 0.0) for s, _ in drafted},
            verify_s={} if gated else {s.name: s.timings.get("verify", 0.0) for s, _ in drafted},
            consulted=consulted or {}, decision=decision,
        )

    def _append(self, record: RoundRecord) -> Iterator[Event]:
        """The winner joins the answer and is streamed at once."""
        chosen, stats = record.candidates[record.winner_index], self.stats
        self.text += chosen.text
        stats.rounds = record.index
        stats.wins[chosen.model] += 1
        stats.tokens += chosen.n_tokens
        stats.gated_rounds += record.gated
        stats.model_calls = self.seats.calls
        live, self.live = self.live, None
        if live is not None and live.first_at is not None and stats.time_to_first_segment_s is None:
            stats.time_to_first_segment_s = live.first_at - self.started
        if chosen.text:
            segment = Segment(text=chosen.text, model=chosen.model, round=record.index, trail=chosen.trail)
            self.segments.append(segment)
            if stats.time_to_first_segment_s is None:
                stats.time_to_first_segment_s = time.perf_counter() - self.started
            sent = live.sent if live is not None else ""
            if not sent:
                yield SegmentEvent(segment)
            elif chosen.text.startswith(sent):  # the rest of what went out as the leader wrote it
                if len(chosen.text) > len(sent):
                    yield SegmentEvent(Segment(text=chosen.text[len(sent):], model=chosen.model, round=record.index))
            else:  # never expected: what went out is always kept
                log.error("round %d: the streamed text %r is not where the segment %r starts", record.index, sent,
                          chosen.text)
                yield SegmentEvent(segment)

    def _finish(self, reason: str) -> Steps:
        self.stats.finish_reason = reason
        self.stats.total_s = time.perf_counter() - self.started
        self.stats.model_calls = self.seats.calls
        yield from self.seats.release(self.seats.active)
        seats = self.seats.all
        invalid = self.constraint.check(self.text) if self.constraint is not None and reason == "stop" else None
        yield DoneEvent(Result(
            valid=None if self.constraint is None or reason != "stop" else invalid is None, invalid_reason=invalid,
            text=self.text, segments=self.segments, rounds=self.rounds, stats=self.stats,
            models=[s.name for s in seats], departures=self.seats.departures, weights=dict(self.weights),
            counters=dict(self.seats.counters), prompt_bpb={s.name: s.bpb for s in seats if s.bpb is not None},
        ))
