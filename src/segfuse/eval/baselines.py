"""The systems SpecFuse is compared with, built on the same member protocol.

- :func:`write_answer`: one member answers by itself, drafting in chunks on one
  session (cut into segments as the engine cuts them), so its answer is what
  that member would say under the same prompt and sampling; :func:`answer_output`
  reports it like the other systems.
- :func:`rerank`: a response-level ensemble (LLM-Blender's idea without its
  trained ranker): every member writes a full answer, every member scores every
  full answer (mean token log-probability, normalised across answers like the
  engine normalises segments), the best total wins. Nothing can be shown
  before the winner is known, so its time to first token is its total time.
- :func:`fused`: the SpecFuse engine itself, reported in the same shape.

Each returns a :class:`SystemOutput` (text, timings, member calls, tokens), so
the evaluation harness and the benchmark compare like with like.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..backends.base import Member, MemberSession
from ..backends.likelihood import score_in_pieces
from ..engine import Draft, aggregate, cut_segment, drive, member_seed, normalise, pick_winner, raw_score
from ..ensemble import Ensemble
from ..errors import PromptTooLongError
from ..options import FusionOptions, ScoreMode
from ..request import FusionRequest
from ..types import DoneEvent, Message, Result, Sampling, TokenScores

DEFAULT_CHUNK = 16
"""Tokens a lone member drafts per call: small enough to time the first token
closely, large enough that re-drafting a cut-off word is rare overhead."""


@dataclass
class MemberAnswer:
    """One member's complete answer with what it cost."""

    model: str
    text: str
    tokens: int
    member_calls: int
    ttft_s: float | None
    total_s: float
    finish_reason: str
    own_logprobs: tuple[float, ...] | None = None  # the writer's scores of `text`, when known


@dataclass
class SystemOutput:
    """What any compared system returns for one prompt."""

    text: str
    ttft_s: float | None  # time to the first text the user could see
    total_s: float
    member_calls: int
    tokens: int  # tokens of the returned answer
    finish_reason: str = ""
    wins: dict[str, int] | None = None  # segments (fused) or answers (rerank) won per member
    rounds: int | None = None
    weights: dict[str, float] | None = None  # fused: voting weights at the end (Hedge)
    extra: dict[str, object] = field(default_factory=dict)


def write_answer(
    member: Member,
    messages: Sequence[Message],
    *,
    max_tokens: int,
    sampling: Sampling,
    stop: Sequence[str] = (),
    chunk: int = DEFAULT_CHUNK,
    deterministic: bool = False,
) -> MemberAnswer:
    """Let `member` answer alone on one session, `chunk` tokens per draft call (`deterministic`: as
    :meth:`Member.start` says, the same text whatever the member's prefix cache holds)."""
    started = time.perf_counter()
    session = member.start(messages, seed=sampling.seed, reserve=chunk + 1, deterministic=deterministic)
    try:
        # Like the engine: a run forced to full length (ignore_eos) ignores the member's stops too.
        stops = (*stop, *(() if sampling.ignore_eos else session.stops))
        writing = _Writing(member.name, started, max_tokens, chunk, n=chunk)
        while n := writing.next_size(session.room):
            writing.add(session, cut_segment(member.name, session.draft(n, sampling), writing.text, stops))
    finally:
        session.close()
    return writing.answer(time.perf_counter() - started)


@dataclass
class _Writing:
    """A lone member's answer in progress: segments cut as the engine cuts them."""

    model: str
    started: float
    max_tokens: int
    chunk: int
    n: int  # the next draft's size
    text: str = ""
    tokens: int = 0
    calls: int = 0
    ttft: float | None = None
    logprobs: list[float] | None = field(default_factory=list)
    finish: str = ""  # set when the answer ends: stop, length or context

    def next_size(self, room: int) -> int:
        """Tokens to draft next, or 0 when the answer has ended (or the budget or the window is spent)."""
        budget = self.max_tokens - self.tokens
        if self.finish or budget <= 0:
            self.finish = self.finish or "length"
            return 0
        self.n = min(self.n, budget)
        if room < self.n + 1:
            self.finish = "context"
            return 0
        return self.n

    def add(self, session: MemberSession, segment: Draft) -> None:
        self.calls += 1
        if not segment.eligible:
            # One word longer than the draft (or a split character): draft longer, up to the budget.
            session.accept("")
            if self.n >= self.max_tokens - self.tokens:
                self.finish = "length"
            self.n *= 2
            return
        candidate = segment.candidate
        if segment.own_scores is None:
            self.logprobs = None  # a stop cut inside a token: scores no longer align
        elif self.logprobs is not None:
            self.logprobs.extend(segment.own_scores.logprobs[: candidate.n_tokens])
        session.accept(candidate.text)
        self.text += candidate.text
        self.tokens += candidate.n_tokens
        if candidate.text and self.ttft is None:
            self.ttft = time.perf_counter() - self.started
        self.finish = "stop" if candidate.finished else ""
        self.n = self.chunk

    def answer(self, total_s: float) -> MemberAnswer:
        return MemberAnswer(
            model=self.model,
            text=self.text,
            tokens=self.tokens,
            member_calls=self.calls,
            ttft_s=self.ttft,
            total_s=total_s,
            finish_reason=self.finish or "length",
            own_logprobs=tuple(self.logprobs) if self.logprobs else None,
        )


ANSWER_FIELDS = ("text", "ttft_s", "total_s", "member_calls", "tokens", "finish_reason")
"""What a member's answer and a system's output both hold, under the same names."""


def answer_output(answer: MemberAnswer) -> SystemOutput:
    """An answer reported as a system output."""
    return SystemOutput(**{name: getattr(answer, name) for name in ANSWER_FIELDS})


def score_answers(member: Member, messages: Sequence[Message], texts: Sequence[str]) -> tuple[list[TokenScores], int]:
    """`member`'s per-token scores of each text as the whole answer; returns (scores, calls).

    One session holds the prompt; each text is scored on it in its own call
    (the backend keeps one cache sequence per candidate). A text too long for
    one batch is scored in pieces on a fresh session instead. An empty text
    scores the member's end-of-generation token ("no answer").
    """
    results: dict[int, TokenScores] = {}
    calls = 0
    session = member.start(messages, seed=None, reserve=1)
    try:
        for i, text in enumerate(texts):
            try:
                results[i] = session.score([text])[0]
                calls += 1
            except (PromptTooLongError, ValueError):  # more tokens than one batch holds: below
                pass
    finally:
        session.close()  # before opening another: a member may hold one session at a time
    for i, text in enumerate(texts):
        if i not in results:
            results[i], used = score_in_pieces(member, messages, text)
            calls += used
    return [results[i] for i in range(len(texts))], calls


def rerank(
    members: Sequence[Member],
    messages: Sequence[Message],
    *,
    max_tokens: int,
    sampling: Sampling,
    stop: Sequence[str] = (),
    score: ScoreMode = "mean_logprob",
    answers: Sequence[MemberAnswer | None] | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> SystemOutput:
    """Response-level ensemble: every member answers, every member scores every answer.

    `answers[i]`, when given, is member i's answer already written under the
    same prompt and sampling (for example by :func:`write_answer` for the
    member-alone baseline); its measured cost is counted as if written here.
    Member i samples with seed ``member_seed(sampling.seed, i)``, as in the engine.
    """
    written = _answers(
        members, messages, max_tokens=max_tokens, sampling=sampling, stop=stop, answers=answers, chunk=chunk
    )
    scoring_started = time.perf_counter()
    rows, scoring_calls = _score_rows(members, messages, written, score)
    calls = sum(a.member_calls for a in written) + scoring_calls
    totals = aggregate(rows, [1.0 / len(members)] * len(members))
    best = pick_winner(totals)
    winner = written[best]
    # Members run one after another on one machine: writing times add up.
    total_s = sum(a.total_s for a in written) + time.perf_counter() - scoring_started
    # The winner's answer, at the cost of the whole rerank.
    return replace(
        answer_output(winner),
        ttft_s=total_s,  # nothing is shown before the winner is known
        total_s=total_s,
        member_calls=calls,
        wins={a.model: int(i == best) for i, a in enumerate(written)},
        extra={"aggregate": totals, "winner": winner.model},
    )


def _answers(
    members: Sequence[Member],
    messages: Sequence[Message],
    *,
    max_tokens: int,
    sampling: Sampling,
    stop: Sequence[str],
    answers: Sequence[MemberAnswer | None] | None,
    chunk: int,
) -> list[MemberAnswer]:
    """Each member's answer: the one given, else written now with the member's own seed."""
    written: list[MemberAnswer] = []
    for i, member in enumerate(members):
        given = answers[i] if answers is not None else None
        if given is None:
            seeded = replace(sampling, seed=member_seed(sampling.seed, i))
            given = write_answer(member, messages, max_tokens=max_tokens, sampling=seeded, stop=stop, chunk=chunk)
        written.append(given)
    return written


def _score_rows(
    members: Sequence[Member], messages: Sequence[Message], written: Sequence[MemberAnswer], score: ScoreMode
) -> tuple[list[list[float]], int]:
    """Per verifier, its normalised scores of every answer, and the member calls that took.

    Every verifier scores every distinct answer once (identical answers tie exactly); its own
    answer's scores are kept from writing it.
    """
    texts = list(dict.fromkeys(a.text for a in written))
    rows: list[list[float]] = []
    calls = 0
    for j, member in enumerate(members):
        known: dict[str, TokenScores] = {}
        own = written[j]
        if own.own_logprobs is not None and score != "mean_logit":  # drafting kept no logits
            known[own.text] = TokenScores(own.own_logprobs, own.own_logprobs)
        missing = [t for t in texts if t not in known]
        if missing:
            scores, used = score_answers(member, messages, missing)
            known.update(zip(missing, scores))
            calls += used
        rows.append(normalise([raw_score(known[a.text], score) for a in written], score))
    return rows, calls


def fused(ensemble: Ensemble, request: FusionRequest) -> SystemOutput:
    """The SpecFuse engine on `ensemble` (on the request's members, from its weights), reported like the
    baselines."""
    for event in drive(ensemble.steps(request)):
        if isinstance(event, DoneEvent):
            result = event.result
            stats = result.stats
            return SystemOutput(
                text=result.text,
                ttft_s=stats.time_to_first_segment_s,
                total_s=stats.total_s,
                member_calls=stats.model_calls,
                tokens=stats.tokens,
                finish_reason=stats.finish_reason,
                wins=dict(stats.wins),
                rounds=stats.rounds,
                weights=dict(result.weights),
                extra=_selection_record(result, request.options),
            )
    raise RuntimeError("the engine ended without a result")


def _selection_record(result: Result, options: FusionOptions) -> dict[str, object]:
    """What the selection mechanisms did in one answer (kept in evaluation records)."""
    leaders = [r.leader for r in result.rounds if r.leader]
    verdicts = [v for r in result.rounds for v in r.consulted.values()]
    return {
        "members": result.models,
        "consulted_rounds": sum(1 for r in result.rounds if r.consulted),
        "proposals": len(verdicts),
        "accepted": sum(1 for v in verdicts if v.startswith("accepted")),
        "options": options.model_dump(mode="json", exclude={"max_tokens", "seed", "temperature", "top_p", "stop"}),
        "gated_rounds": result.stats.gated_rounds,
        "penalised": sum(len(r.penalised) for r in result.rounds),
        "leader": leaders[0] if leaders else None,
        "prompt_bpb": {k: round(v, 4) for k, v in result.prompt_bpb.items()},
        "departures": [f"{d.model}@{d.round}:{d.kind}" for d in result.departures],
    }
