"""The SpecFuse loop: draft -> verify -> rank -> broadcast, one segment per round.

Backend-agnostic and free of I/O: it drives member sessions through the
protocol in ``backends.base`` and yields events. See NOTES §1 for the method.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .backends.base import Member, MemberSession
from .errors import InvalidRequestError
from .options import FusionOptions
from .scoring import aggregate, normalise, pick_winner, raw_score
from .segments import apply_stops, cut_draft
from .types import (
    Candidate,
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
        n_text = _tokens_covering(tokens.pieces, len(text.encode("utf-8")))
    return _Draft(Candidate(name, text, finished, n_text), own)


def _tokens_covering(pieces: Sequence[bytes], n_bytes: int) -> int:
    covered = count = 0
    while covered < n_bytes and count < len(pieces):
        covered += len(pieces[count])
        count += 1
    return count


def fuse(
    members: Sequence[Member], messages: Sequence[Message], options: FusionOptions
) -> Iterator[Event]:
    """Run one fused generation, yielding events; the last is a DoneEvent."""
    if not members:
        raise InvalidRequestError("no members to fuse", "give at least one model")
    names = [m.name for m in members]
    k = len(members)
    sessions: list[MemberSession] = []
    try:
        started = time.perf_counter()
        for i, member in enumerate(members):
            sessions.append(
                member.start(messages, seed=member_seed(options.seed, i), reserve=k * options.window + 1)
            )
        yield from _loop(names, sessions, options, started)
    finally:
        for session in sessions:
            session.close()


def _loop(
    names: list[str], sessions: list[MemberSession], options: FusionOptions, started: float
) -> Iterator[Event]:
    k = len(sessions)
    weights = [1.0 / k] * k
    answer = ""
    segments: list[Segment] = []
    rounds: list[RoundRecord] = []
    stats = Stats(wins={n: 0 for n in names})
    sampling = options.sampling

    while True:
        budget = options.max_tokens - stats.tokens
        if budget <= 0:
            stats.finish_reason = "length"
            break
        if min(s.room for s in sessions) < k * options.window + 1:
            stats.finish_reason = "context"
            break
        round_start = time.perf_counter()
        record_draft: dict[str, float] = {}
        record_verify: dict[str, float] = {}

        # 1. Draft. If no draft is usable (e.g. all end mid-character), retry longer.
        n = min(options.window, budget)
        while True:
            drafts = []
            for name, session in zip(names, sessions):
                t0 = time.perf_counter()
                tokens = session.draft(n, sampling)
                record_draft[name] = record_draft.get(name, 0.0) + time.perf_counter() - t0
                stats.model_calls += 1
                drafts.append(_cut(name, tokens, answer, (*options.stop, *session.stops)))
            if any(d.eligible for d in drafts) or n >= budget:
                break
            for session in sessions:
                session.accept("")
            n = min(2 * n, budget)
        if not any(d.eligible for d in drafts):
            stats.finish_reason = "length"
            break

        # 2. Verify: every member scores every distinct eligible text once; identical
        # texts from different members share one score, so ties are exact.
        raw: dict[str, list[float | None]] = {}
        normalised: dict[str, list[float]] = {}
        for j, (name, session) in enumerate(zip(names, sessions)):
            known: dict[str, TokenScores] = {}
            if drafts[j].own_scores is not None:
                known[drafts[j].candidate.text] = drafts[j].own_scores
            texts = [d.candidate.text for d in drafts if d.eligible]
            unique = [t for t in dict.fromkeys(texts) if t not in known]
            t0 = time.perf_counter()
            if unique:
                known.update(zip(unique, session.score(unique)))
                stats.model_calls += 1
            record_verify[name] = time.perf_counter() - t0
            row: list[float | None] = [
                raw_score(known[d.candidate.text], options.score)
                if d.eligible and (i != j or options.self_score)
                else None
                for i, d in enumerate(drafts)
            ]
            raw[name] = row
            normalised[name] = normalise(row, options.score)

        # 3. Rank.
        totals = aggregate([normalised[n] for n in names], weights)
        winner = pick_winner(totals, [d.eligible for d in drafts])
        chosen = drafts[winner].candidate

        # 4. Broadcast: every member's context gets the winning text.
        answer += chosen.text
        for session in sessions:
            session.accept(chosen.text)
        stats.rounds += 1
        stats.wins[chosen.model] += 1
        stats.tokens += chosen.n_tokens
        segment = Segment(text=chosen.text, model=chosen.model, round=stats.rounds)
        if chosen.text:
            segments.append(segment)
            if stats.time_to_first_segment_s is None:
                stats.time_to_first_segment_s = time.perf_counter() - started
            yield SegmentEvent(segment)
        record = RoundRecord(
            index=stats.rounds,
            active=list(names),
            candidates=[d.candidate for d in drafts],
            raw_scores=raw,
            scores=normalised,
            aggregate=totals,
            winner_index=winner,
            draft_s=record_draft,
            verify_s=record_verify,
            total_s=time.perf_counter() - round_start,
        )
        rounds.append(record)
        yield RoundEvent(record)
        if chosen.finished:
            stats.finish_reason = "stop"
            break

    stats.total_s = time.perf_counter() - started
    yield DoneEvent(Result(text=answer, segments=segments, rounds=rounds, stats=stats, models=names))
