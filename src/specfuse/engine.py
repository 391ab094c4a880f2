"""The SpecFuse loop: draft -> verify -> rank -> broadcast, one segment per round.

Backend-agnostic and free of I/O: a generation is a coroutine
(:func:`fusion_steps`) that yields events and the member calls it needs
(``calls.py``); :func:`fuse` runs one generation, ``scheduler.py`` runs many
together. Members follow the protocol in ``backends.base``. See NOTES §1.

Members take part while *active*. A member leaves a query when Model Exit
finds it lagging (``options.exit``) or when one of its calls raises (a fault:
a dead server, a timeout, garbage); the answer completes with the others and
the departure is recorded. Members whose class sets ``parallel_safe = True``
(remote servers) are called concurrently; local CPU members run one by one.

Selection (``selection.py``): with a confidence ``gate`` the *leader* (the
heaviest member, or the one named) drafts first and its draft wins alone when
its own mean token probability reaches the gate; only otherwise do the others
draft and vote. The degeneration ``guard`` keeps looping candidates from
winning; ``prior="prompt"`` starts the voting weights from each member's bits
per byte on the prompt; ``exit_votes="others"`` bases Model Exit on cross-votes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .backends.base import Member, MemberSession
from .calls import Call, CallRunner, Calls, Reply
from .errors import InvalidRequestError, MemberFailedError
from .options import FusionOptions
from .scoring import aggregate, exit_reason, hedge_update, model_exit, normalise, pick_winner, raw_score
from .segments import apply_stops, cut_draft, tokens_covering
from .selection import (
    bits_per_byte,
    continues_loop,
    cross_quality,
    degeneration,
    gate_passes,
    guard_eligible,
    mean_probability,
    pick_leader,
    prompt_weights,
)
from .types import (
    Candidate,
    Departure,
    DoneEvent,
    DraftTokens,
    Event,
    Message,
    Result,
    RoundEvent,
    RoundRecord,
    Segment,
    SegmentEvent,
    Stats,
    TokenScores,
)


@dataclass
class _Draft:
    """A cut draft plus the member's own scores of the kept text, when known."""

    candidate: Candidate
    own_scores: TokenScores | None

    @property
    def eligible(self) -> bool:
        return bool(self.candidate.text) or self.candidate.finished


@dataclass
class _Seat:
    """A member's place in one query."""

    name: str
    member: Member
    session: MemberSession | None = None
    quality: float = 0.0  # cumulative aggregate score of its drafts (Model Exit)
    bpb: float | None = None  # bits per byte of the prompt (prompt-fit prior)
    timings: dict[str, float] = field(default_factory=dict)


# A generation as a coroutine: it yields events and member calls, is sent the replies to calls.
Steps = Generator[Event | Calls, list[Reply] | None, None]


def member_seed(seed: int | None, index: int) -> int | None:
    """A distinct, reproducible seed per member (two copies of a model differ)."""
    return None if seed is None else seed * 7919 + index


def _cut(name: str, tokens: DraftTokens, answer: str, stops: Sequence[str]) -> _Draft:
    cut = cut_draft(tokens.pieces, tokens.finished)
    n_text = cut.n_tokens - (1 if tokens.finished and cut.n_tokens else 0)
    text, hit_stop = apply_stops(answer, cut.text, stops)
    finished = tokens.finished or hit_stop
    own: TokenScores | None = None
    if text == cut.text and cut.n_tokens:
        # The kept tokens are a prefix of the draft: their scores are already known.
        # An empty finished draft is the candidate "stop here": its score is the EOG token's.
        span = slice(0, n_text) if n_text else slice(cut.n_tokens - 1, cut.n_tokens)
        own = TokenScores(tokens.logprobs[span], tokens.logits[span])
    if text != cut.text:  # truncated at a stop string: count the tokens that wrote it
        n_text = tokens_covering(tokens.pieces, len(text.encode("utf-8")))
    return _Draft(Candidate(name, text, finished, n_text), own)


def fusion_steps(
    members: Sequence[Member],
    messages: Sequence[Message],
    options: FusionOptions,
    *,
    weights: Mapping[str, float] | None = None,
) -> Steps:
    """One fused generation as a coroutine: it yields events and member calls.

    A ``Calls`` item asks for work on member sessions; the driver runs it (one
    by one, concurrently, or batched with other generations' calls) and sends
    back one result or exception per call. Any other item is an event; send
    None after it. Closing the coroutine closes its member sessions.
    See :func:`fuse` for the plain driver and ``scheduler.py`` for many at once.
    """
    if not members:
        raise InvalidRequestError("no members to fuse", "give at least one model")
    seats = [_Seat(m.name, m) for m in members]
    if options.leader != "auto" and options.leader not in {s.name for s in seats}:
        raise InvalidRequestError(
            f"leader {options.leader!r} is not a member", f"members: {', '.join(s.name for s in seats)}; or auto"
        )
    run = _Run(seats, options, weights)
    try:
        yield from run.events(messages)
    finally:
        for seat in seats:
            run.leave(seat)


def fuse(
    members: Sequence[Member],
    messages: Sequence[Message],
    options: FusionOptions,
    *,
    weights: Mapping[str, float] | None = None,
) -> Iterator[Event]:
    """Run one fused generation, yielding events; the last is a DoneEvent.

    `weights` are initial voting weights by member name (Hedge carried across
    queries); missing members get the mean weight.
    """
    steps = fusion_steps(members, messages, options, weights=weights)
    with CallRunner() as runner:
        try:
            reply = None
            while True:
                item = steps.send(reply)
                if isinstance(item, Calls):
                    reply = runner.run(item.calls)
                else:
                    reply = None
                    yield item
        except StopIteration:
            return
        finally:
            steps.close()


class _Run:
    """State of one fused generation."""

    def __init__(self, seats: list[_Seat], options: FusionOptions, weights: Mapping[str, float] | None) -> None:
        self.seats = seats
        self.options = options
        self.active: list[_Seat] = []
        self.departures: list[Departure] = []
        self.round_departures: list[Departure] = []
        k = len(seats)
        start = dict(weights or {})
        mean = sum(start.values()) / len(start) if start else 1.0 / k
        self.weights = {s.name: start.get(s.name, mean) for s in seats}
        self.stats = Stats(wins={s.name: 0 for s in seats})
        self.counters: dict[str, dict[str, int]] = {}  # backend work per member, at leaving
        self.lead: str | None = None  # the gate's leader, fixed at its first round
        self.hopeless = 0  # votes in a row whose winner still looped (guard patience)

    # --- membership ----------------------------------------------------------
    def leave(self, seat: _Seat) -> None:
        if seat.session is not None:
            try:
                self.counters[seat.name] = seat.session.counters()
                seat.session.close()
            except Exception:
                pass  # a broken member must not stop the others from finishing
            seat.session = None
        if seat in self.active:
            self.active.remove(seat)

    def depart(self, seat: _Seat, round_no: int, kind: str, reason: str) -> None:
        departure = Departure(seat.name, round_no, kind, reason)  # type: ignore[arg-type]
        self.departures.append(departure)
        self.round_departures.append(departure)
        self.leave(seat)
        if not self.active:
            raise MemberFailedError(
                f"no member is left to answer (last: {seat.name}: {reason})",
                "check the members' servers or files and retry",
            )

    def survivors(self, seats: Sequence[_Seat], outcomes: Sequence[Any], round_no: int,
                  phase: str) -> list[tuple[_Seat, Any]]:
        """Drop members whose call raised; return (seat, result) of the others."""
        kept = []
        for seat, outcome in zip(seats, outcomes):
            if isinstance(outcome, Exception):
                reason = f"{phase} failed: {type(outcome).__name__}: {outcome}"
                self.depart(seat, round_no, "fault", reason)
            else:
                kept.append((seat, outcome))
        return kept

    # --- the loop ------------------------------------------------------------
    def each(self, seats: Sequence[_Seat], phase: str, method: str,
             args: Callable[[_Seat], tuple[Any, ...]] = lambda seat: ()) -> Generator[Calls, list[Reply], list[Any]]:
        """Ask the driver to call ``method`` on each seat's session; the result or exception per seat.

        The seconds each seat waited add up under ``seat.timings[phase]``.
        """
        if not seats:
            return []
        replies = yield Calls([Call(s.member, s.session, method, args(s)) for s in seats])
        for seat, reply in zip(seats, replies):
            seat.timings[phase] = seat.timings.get(phase, 0.0) + reply.seconds
        return [reply.value for reply in replies]

    def events(self, messages: Sequence[Message]) -> Steps:
        options, stats = self.options, self.stats
        started = time.perf_counter()
        reserve = len(self.seats) * options.window + 1
        failed: list[tuple[_Seat, Exception]] = []
        for i, seat in enumerate(self.seats):
            try:
                seat.session = seat.member.start(messages, seed=member_seed(options.seed, i), reserve=reserve)
            except InvalidRequestError:
                raise  # the request itself is wrong (e.g. too long): no member could answer it
            except Exception as exc:
                failed.append((seat, exc))
                continue
            self.active.append(seat)
        for seat, exc in failed:
            self.departures.append(Departure(seat.name, 0, "fault", f"start failed: {type(exc).__name__}: {exc}"))
        if not self.active:
            raise MemberFailedError(
                "no member could start: " + "; ".join(d.reason for d in self.departures),
                "check the members' servers or files and retry",
            )

        if self.options.prior == "prompt":
            yield from self._prompt_prior(messages)

        answer = ""
        segments: list[Segment] = []
        rounds: list[RoundRecord] = []
        while True:
            budget = options.max_tokens - stats.tokens
            if budget <= 0:
                stats.finish_reason = "length"
                break
            if min(s.session.room for s in self.active) < len(self.active) * options.window + 1:
                stats.finish_reason = "context"
                break
            round_no = stats.rounds + 1
            round_start = time.perf_counter()
            record = yield from self._round(round_no, answer, budget, segments[-1].text if segments else "")
            if record is None:
                stats.finish_reason = "length"
                break
            chosen = record.candidates[record.winner_index]
            answer += chosen.text
            stats.rounds = round_no
            stats.wins[chosen.model] += 1
            stats.tokens += chosen.n_tokens
            stats.gated_rounds += record.gated
            if chosen.text:
                segment = Segment(text=chosen.text, model=chosen.model, round=round_no)
                segments.append(segment)
                if stats.time_to_first_segment_s is None:
                    stats.time_to_first_segment_s = time.perf_counter() - started
                yield SegmentEvent(segment)
            yield from self._broadcast(chosen.text, round_no)
            if options.exit and not chosen.finished and not record.gated:
                self._model_exit(round_no)
            record.departures = list(self.round_departures)
            record.total_s = time.perf_counter() - round_start
            rounds.append(record)
            yield RoundEvent(record)
            if chosen.finished:
                stats.finish_reason = "stop"
                break

        stats.total_s = time.perf_counter() - started
        for seat in list(self.active):
            self.counters[seat.name] = seat.session.counters()
        yield DoneEvent(Result(
            text=answer, segments=segments, rounds=rounds, stats=stats,
            models=[s.name for s in self.seats], departures=self.departures,
            weights=dict(self.weights), counters=dict(self.counters),
            prompt_bpb={s.name: s.bpb for s in self.seats if s.bpb is not None},
        ))

    def _prompt_prior(self, messages: Sequence[Message]) -> Generator[Calls, list[Reply], None]:
        """Start the voting weights from how well each member predicts the prompt (PackLLM-sim).

        Needs every active member's session to offer ``text_logprob``; otherwise
        the weights stay as they were (uniform or carried).
        """
        text = "\n".join(m.content for m in messages if m.role != "assistant").strip()
        seats = list(self.active)
        if not text or not all(callable(getattr(s.session, "text_logprob", None)) for s in seats):
            return
        outcomes = yield from self.each(seats, "prompt", "text_logprob", lambda s: (text,))
        self.stats.model_calls += len(seats)
        fits = self.survivors(seats, outcomes, 0, "prompt fit")
        for seat, (logprob, n_bytes) in fits:
            seat.bpb = bits_per_byte(logprob, n_bytes) if n_bytes else None
        if all(seat.bpb is not None for seat, _ in fits):
            prior = prompt_weights([seat.bpb for seat, _ in fits], self.options.prior_temperature)
            self.weights.update((seat.name, w) for (seat, _), w in zip(fits, prior))

    def _leader(self) -> _Seat | None:
        """The member that drafts first under the gate.

        The named one; with ``leader="auto"`` the largest member when every
        active member states its parameter count, else the heaviest voter.
        Chosen once per query (votes must not promote a member to leader); if
        it departs, the next is chosen the same way among those left.
        """
        seat = next((s for s in self.active if s.name == self.lead), None)
        if seat is None and self.active:
            wanted = self.options.leader
            seat = next((s for s in self.active if s.name == wanted), None) if self.lead is None else None
            sizes = [getattr(s.member, "n_params", None) for s in self.active]
            strength = sizes if all(isinstance(n, int) and n > 0 for n in sizes) else \
                [self.weights[s.name] for s in self.active]
            seat = seat or self.active[pick_leader(strength)]
            self.lead = seat.name
        return seat

    def _draft(self, seats: Sequence[_Seat], n: int, answer: str,
               round_no: int) -> Generator[Calls, list[Reply], list[tuple[_Seat, _Draft]]]:
        options = self.options
        outcomes = yield from self.each(seats, "draft", "draft", lambda s: (n, options.sampling))
        self.stats.model_calls += len(seats)
        return [
            (seat, _cut(seat.name, tokens, answer, self._stops(seat)))
            for seat, tokens in self.survivors(seats, outcomes, round_no, "draft")
        ]

    def _degenerates(self, answer: str, text: str, last: str) -> str | None:
        o = self.options
        if not o.guard:
            return None
        return degeneration(answer, text, last, n=o.guard_ngram, times=o.guard_times, share=o.guard_share)

    def _round(self, round_no: int, answer: str, budget: int,
               last: str) -> Generator[Calls, list[Reply], RoundRecord | None]:
        options, stats = self.options, self.stats
        self.round_departures = []
        for seat in self.active:
            seat.timings = {}
        calls_before = stats.model_calls
        n = min(options.window, budget)

        # 0. Gate: the leader drafts alone; a confident, non-looping draft wins outright.
        leader = self._leader() if options.gate is not None and len(self.active) > 1 else None
        early: list[tuple[_Seat, _Draft]] = []
        confidence: float | None = None
        if leader is not None:
            early = yield from self._draft([leader], n, answer, round_no)
            if early:
                d = early[0][1]
                confidence = mean_probability(d.own_scores.logprobs) if d.own_scores else 0.0
                # A looping draft goes to a vote, unless votes have shown that everyone loops here.
                patient = self.hopeless < options.guard_patience
                if d.eligible and gate_passes(confidence, options.gate) and not (
                    patient and self._degenerates(answer, d.candidate.text, last)
                ):
                    return RoundRecord(
                        index=round_no, active=[leader.name], candidates=[d.candidate], raw_scores={},
                        scores={}, weights={leader.name: 1.0}, aggregate=[1.0], winner_index=0,
                        model_calls=stats.model_calls - calls_before, gated=True, leader=leader.name,
                        confidence=confidence, draft_s={leader.name: leader.timings.get("draft", 0.0)},
                    )

        # 1. Draft. If no draft is usable (e.g. all end mid-character), retry longer.
        while True:
            done = {id(seat) for seat, _ in early}
            fresh = yield from self._draft([s for s in self.active if id(s) not in done], n, answer, round_no)
            order = {id(s): i for i, s in enumerate(self.active)}
            drafted = sorted(
                [(seat, d) for seat, d in (*early, *fresh) if seat in self.active], key=lambda p: order[id(p[0])]
            )
            if any(d.eligible for _, d in drafted) or n >= budget:
                break
            for seat, _ in drafted:
                seat.session.accept("")
            early = []
            n = min(2 * n, budget)
        if not any(d.eligible for _, d in drafted):
            return None

        # 2. Verify: every member scores every distinct eligible text once; identical
        # texts share one score, so ties between them are exact.
        texts = list(dict.fromkeys(d.candidate.text for _, d in drafted if d.eligible))
        known: dict[str, dict[str, TokenScores]] = {}
        asks: dict[str, list[str]] = {}
        for seat, d in drafted:
            own = {d.candidate.text: d.own_scores} if d.own_scores is not None else {}
            known[seat.name] = own
            asks[seat.name] = [t for t in texts if t not in own]
        seats = [seat for seat, _ in drafted]
        asking = [s for s in seats if asks[s.name]]
        scored = yield from self.each(asking, "verify", "score", lambda s: (asks[s.name],))
        answered = dict(zip(map(id, asking), scored))
        outcomes = [answered.get(id(s), []) for s in seats]
        stats.model_calls += sum(1 for s in seats if asks[s.name])
        verified = {seat.name for seat, _ in self.survivors(seats, outcomes, round_no, "verify")}
        for seat, scores in zip(seats, outcomes):
            if seat.name in verified:
                known[seat.name].update(zip(asks[seat.name], scores))
        drafted = [(seat, d) for seat, d in drafted if seat.name in verified]
        if not any(d.eligible for _, d in drafted):
            return None

        # 3. Rank: normalise per verifier, weight, aggregate; looping candidates may not win.
        names = [seat.name for seat, _ in drafted]
        raw: dict[str, list[float | None]] = {}
        normalised: dict[str, list[float]] = {}
        for j, (seat, _) in enumerate(drafted):
            row = [
                raw_score(known[seat.name][d.candidate.text], options.score)
                if d.eligible and (i != j or options.self_score) else None
                for i, (_, d) in enumerate(drafted)
            ]
            raw[seat.name] = row
            normalised[seat.name] = normalise(row, options.score)
        matrix = [normalised[n] for n in names]
        weights = self._active_weights(names)
        if options.hedge:
            weights = hedge_update(weights, matrix, round_no, options.hedge_eta)
            self.weights.update(zip(names, weights))
        totals = aggregate(matrix, weights)
        penalised = {
            d.candidate.model: why
            for _, d in drafted
            if d.eligible and (why := self._degenerates(answer, d.candidate.text, last))
        }
        eligible = guard_eligible([d.eligible for _, d in drafted], [d.candidate.model in penalised for _, d in drafted])
        winner = pick_winner(totals, eligible)
        # Guard patience: a vote whose winner still loops (penalised, or however short continuing a loop)
        # is a vote the guard lost.
        won = drafted[winner][1].candidate
        stuck = options.guard and (won.model in penalised or continues_loop(
            answer, won.text, n=options.guard_ngram, times=options.guard_times, share=options.guard_share))
        self.hopeless = self.hopeless + 1 if stuck else 0
        for i, ((seat, _), total) in enumerate(zip(drafted, totals)):
            seat.quality += cross_quality(matrix, weights, i) if options.exit_votes == "others" else total

        return RoundRecord(
            index=round_no,
            active=names,
            candidates=[d.candidate for _, d in drafted],
            raw_scores=raw,
            scores=normalised,
            weights=dict(zip(names, weights)),
            aggregate=totals,
            winner_index=winner,
            model_calls=stats.model_calls - calls_before,
            draft_s={s.name: s.timings.get("draft", 0.0) for s, _ in drafted},
            verify_s={s.name: s.timings.get("verify", 0.0) for s, _ in drafted},
            leader=leader.name if leader is not None else None,
            confidence=confidence,
            penalised=penalised,
        )

    def _stops(self, seat: _Seat) -> tuple[str, ...]:
        member_stops = () if self.options.ignore_eos else seat.session.stops
        return (*self.options.stop, *member_stops)

    def _active_weights(self, names: Sequence[str]) -> list[float]:
        values = [self.weights[n] for n in names]
        total = sum(values)
        return [v / total for v in values] if total > 0 else [1.0 / len(names)] * len(names)

    def _broadcast(self, text: str, round_no: int) -> Generator[Calls, list[Reply], None]:
        """Every member's context gets the winning text."""
        seats = list(self.active)
        outcomes = yield from self.each(seats, "accept", "accept", lambda s: (text,))
        self.survivors(seats, outcomes, round_no, "accept")

    def _model_exit(self, round_no: int) -> None:
        o = self.options
        quality = [s.quality for s in self.active]
        leaving = model_exit(
            quality, round_no, warmup=o.exit_warmup, entropy_threshold=o.exit_entropy,
            temperature=o.exit_temperature, fraction=o.exit_fraction, min_active=o.exit_min_active,
        )
        seats = list(self.active)
        leader = self._leader() if o.gate is not None else None
        for i in leaving:
            if seats[i] is leader:  # chosen by evidence the votes cannot inflate: it stays
                continue
            self.depart(seats[i], round_no, "exit", exit_reason(quality, i, o.exit_temperature))

