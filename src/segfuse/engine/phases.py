"""The steps of one round, one function each, named as the method names them
(docs/design.md#a-round).

- :func:`gate`: does the leader's draft win alone? (pure)
- :func:`draft`: members continue the answer by one segment, cut to whole words;
- :func:`consult`: when the leader is unsure, it verifies the others' proposals first;
- :func:`verify`: every member scores every distinct candidate once;
- :func:`rank`: scores -> the winner (pure: no member calls, no state);
- :func:`broadcast`: every member's context gets the winning text;
- :func:`model_exit`: members whose cumulative quality lags leave the query;
- :func:`prompt_prior`: before the first round, voting weights from prompt fit.

The generator functions yield member calls through :class:`~segfuse.engine.seats.Seats`
and return their phase's result; the engine strings them together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ..options import FusionOptions
from ..segments import apply_stops, cut_draft, tokens_covering
from ..types import Candidate, DraftTokens, Message, TokenScores, TokenTrail
from . import selection
from .calls import Asking
from .context import GenerationContext, Round
from .live import LeaderStream
from .scoring import ExitRule, aggregate, exit_reason, hedge_update, normalise, pick_winner, raw_score
from .scoring import model_exit as exit_rule
from .seats import Seat, Seats


@dataclass
class Draft:
    """A cut draft plus its author's own scores of the kept text, when known."""

    candidate: Candidate
    own_scores: TokenScores | None
    rejected: str | None = None  # why the leader did not accept it (it may not win)

    @property
    def eligible(self) -> bool:
        return (bool(self.candidate.text) or self.candidate.finished) and self.rejected is None


Drafted = list[tuple[Seat, Draft]]


def cut_segment(
    author: str, tokens: DraftTokens, answer: str, stops: Sequence[str], *, whole_words: bool = True
) -> Draft:
    """A member's drafted tokens -> a candidate segment: whole words (where `whole_words`: not when the
    tokens are the answer's last, nor the leader's own after reading drafts), whole characters, stop strings."""
    cut = cut_draft(tokens.pieces, tokens.finished, whole_words)
    n_text = cut.n_tokens - (1 if tokens.finished and cut.n_tokens else 0)
    text, hit_stop = apply_stops(answer, cut.text, stops)
    own: TokenScores | None = None
    if text == cut.text and cut.n_tokens:
        # The kept tokens are a prefix of the draft: their scores are already known.
        # An empty finished draft is the candidate "stop here": its score is the EOG token's.
        span = slice(0, n_text) if n_text else slice(cut.n_tokens - 1, cut.n_tokens)
        own = TokenScores(tokens.logprobs[span], tokens.logits[span])
    if text != cut.text:  # truncated at a stop string: count the tokens that wrote it
        n_text = tokens_covering(tokens.pieces, len(text.encode("utf-8")))
    trail = TokenTrail(tokens.pieces[:n_text], tokens.logprobs[:n_text], tokens.tops[:n_text])
    return Draft(Candidate(author, text, tokens.finished or hit_stop, n_text, trail), own)


def degenerates(options: FusionOptions, at: Round, text: str) -> str | None:
    """Why `text` would make the answer loop after the round's start `at`, when the guard is on."""
    if not options.guard:
        return None
    o = options
    return selection.degeneration(at.message, text, at.last, n=o.guard_ngram, times=o.guard_times, share=o.guard_share)


# --- gate ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateCheck:
    passes: bool
    confidence: float  # the leader's own mean token probability of its draft


def gate(leader_draft: Draft, context: GenerationContext, at: Round, *, patient: bool) -> GateCheck:
    """The leader's draft wins alone when it is usable, confident, and (guard on) not a loop.

    A looping draft goes to a vote while the guard is still `patient`.
    """
    options = context.options
    own = leader_draft.own_scores
    confidence = selection.mean_probability(own.logprobs) if own else 0.0
    gated = options.gate is not None and selection.gate_passes(confidence, options.gate)  # (a leader implies a gate)
    passes = leader_draft.eligible and gated and not (patient and degenerates(options, at, leader_draft.candidate.text))
    return GateCheck(passes, confidence)


# --- draft --------------------------------------------------------------------------------


def draft(
    seats: Seats,
    context: GenerationContext,
    chosen: Sequence[Seat],
    n: int,
    at: Round,
    live: LeaderStream | None = None,
) -> Asking:
    """The chosen members draft up to `n` tokens each; (seat, cut draft) of those whose call succeeded.

    Drafts that break the answer's constraint are marked (they may not win); `live`: the leader drafts
    alone and its text goes out as it decodes it, where its session can tell (``live.py``); its draft is
    then kept whole, not cut back to a word's start: no other member reads it, and the tokens past that
    start need not be decoded again next round."""
    how = context.sampling
    if live is not None and len(chosen) == 1 and chosen[0].session is not None and chosen[0].session.streams_text:
        live.restart()
        outcomes = yield from seats.ask(chosen, "draft", "draft", lambda s: (n, how, live.on_text), outlet=live.outlet)
    else:
        outcomes = yield from seats.ask(chosen, "draft", "draft", lambda s: (n, how))
    # The answer's last tokens stay whole: an answer cut by its length ends after exactly its budget.
    whole_words = live is None and n < at.budget
    drafted = [
        (seat, cut_segment(seat.name, tokens, at.message, stops(seat, context), whole_words=whole_words))
        for seat, tokens in seats.survivors(chosen, outcomes, at.no, "draft")
    ]
    for _, d in drafted:
        d.rejected = context.check(at.message, d.candidate) or d.rejected
    return drafted


def draft_all(
    seats: Seats,
    context: GenerationContext,
    at: Round,
    early: Drafted,
    *,
    only: Seat | None = None,
    live: LeaderStream | None = None,
) -> Asking:
    """Every active member that drafts under the context (or `only` one) drafts up to a window, in member
    order; those in `early` already did.

    If no draft is usable (e.g. all end mid-character), the members draft again,
    twice as long, up to the round's budget. Returns the drafts, or [] when none is usable.
    """
    n = min(context.options.window, at.budget)
    while True:
        done = {id(seat) for seat, _ in early}
        chosen = [
            s for s in seats.active if id(s) not in done and (only is None or s is only) and context.drafts(s.member)
        ]
        fresh = yield from draft(seats, context, chosen, n, at, live)
        order = {id(s): i for i, s in enumerate(seats.active)}
        drafted = sorted(
            [(seat, d) for seat, d in (*early, *fresh) if seat in seats.active], key=lambda pair: order[id(pair[0])]
        )
        if any(d.eligible for _, d in drafted):
            return drafted
        if n >= at.budget:
            return []
        retrying = [seat for seat, _ in drafted]
        outcomes = yield from seats.ask(retrying, "draft", "accept", lambda s: ("",))
        seats.survivors(retrying, outcomes, at.no, "accept")
        early, n = [], min(2 * n, at.budget)


def stops(seat: Seat, context: GenerationContext) -> tuple[str, ...]:
    """The request's stop strings plus the member's own (unless the answer must run to length)."""
    options = context.options
    own = () if options.ignore_eos or seat.session is None else seat.session.stops
    return (*options.stop, *own)


# --- consult, verify ----------------------------------------------------------------------


Known = dict[str, dict[str, TokenScores]]  # verifier name -> candidate text -> its scores


def consult(seats: Seats, context: GenerationContext, at: Round, leader: Seat, drafted: Drafted) -> Asking:
    """The leader verifies the others' proposals in one call; a proposal it does not accept may not win.

    Returns the drafts (rejected proposals marked), the leader's scores of the
    proposals, and the verdicts by author. If the leader's call fails it leaves
    the query and every proposal stands.
    """
    own = next(d for seat, d in drafted if seat is leader)
    proposals = [
        (seat, d) for seat, d in drafted if seat is not leader and d.eligible and d.candidate.text != own.candidate.text
    ]
    texts = list(dict.fromkeys(d.candidate.text for _, d in proposals))
    if not texts:
        return drafted, {}, {}
    outcome = yield from seats.ask([leader], "verify", "score", lambda s: (texts,))
    answered = seats.survivors([leader], outcome, at.no, "verify")
    if not answered:
        return [(seat, d) for seat, d in drafted if seat is not leader], {}, {}
    scores = dict(zip(texts, answered[0][1]))
    options = context.options
    verdicts = {
        seat.name: selection.leader_accepts(
            scores[d.candidate.text], own.own_scores, options.accept, options.accept_margin or 0.0
        )
        for seat, d in proposals
    }
    marked = [
        (
            seat,
            d
            if seat.name not in verdicts or verdicts[seat.name].accepted
            else replace(d, rejected=verdicts[seat.name].reason),
        )
        for seat, d in drafted
    ]
    return marked, scores, verdicts


def verify(seats: Seats, at: Round, drafted: Drafted, known_before: Known | None = None) -> Asking:
    """Every member scores every distinct usable candidate once (its own draft's scores are known).

    Identical texts share one score, so ties between them are exact. Scores in
    `known_before` (verifier -> text -> scores) are not asked again. Returns the
    drafts of the members that verified, and what each of them scored.
    """
    texts = list(dict.fromkeys(d.candidate.text for _, d in drafted if d.eligible))
    known: Known = {}
    asks: dict[str, list[str]] = {}
    for seat, d in drafted:
        known[seat.name] = {d.candidate.text: d.own_scores} if d.own_scores is not None else {}
        known[seat.name].update((known_before or {}).get(seat.name, {}))
        asks[seat.name] = [t for t in texts if t not in known[seat.name]]
    verifiers = [seat for seat, _ in drafted]
    asking = [s for s in verifiers if asks[s.name]]
    scored = yield from seats.ask(asking, "verify", "score", lambda s: (asks[s.name],))
    answered = dict(zip(map(id, asking), scored))
    outcomes = [answered.get(id(s), []) for s in verifiers]
    for seat, scores in seats.survivors(verifiers, outcomes, at.no, "verify"):
        known[seat.name].update(zip(asks[seat.name], scores))
    kept = [(seat, d) for seat, d in drafted if seat in seats.active]
    return kept, {seat.name: known[seat.name] for seat, _ in kept}


# --- rank ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ranking:
    """What a vote decided, and every number it used."""

    raw: dict[str, list[float | None]]  # verifier -> raw score of each candidate (None: not scored)
    scores: dict[str, list[float]]  # verifier -> normalised scores
    weights: list[float]  # voting weights used (after Hedge's update, when on)
    totals: list[float]
    winner: int
    penalised: dict[str, str]  # candidate author -> why the guard held it back
    stuck: bool  # the winner still continues a loop (the guard lost this vote)


def rank(
    drafts: Sequence[Draft],
    known: Mapping[str, Mapping[str, TokenScores]],
    weights: Sequence[float],
    context: GenerationContext,
    at: Round,
) -> Ranking:
    """Normalise per verifier, weight, aggregate; looping candidates may not win (guard on; it reads the
    answer and the last segment where the round started).

    ``drafts[i]`` is member i's draft and member i is also verifier i (``known``
    is keyed by the same authors' names, in the same order). Ties go to the
    lowest index.
    """
    options = context.options
    names = [d.candidate.model for d in drafts]
    raw = {
        verifier: [
            raw_score(known[verifier][d.candidate.text], options.score)
            if d.eligible and (i != j or options.self_score)
            else None
            for i, d in enumerate(drafts)
        ]
        for j, verifier in enumerate(names)
    }
    normalised = {verifier: normalise(row, options.score) for verifier, row in raw.items()}
    matrix = [normalised[n] for n in names]
    if options.hedge:
        weights = hedge_update(weights, matrix, at.no, options.hedge_eta)
    totals = aggregate(matrix, weights)
    penalised = {
        d.candidate.model: why for d in drafts if d.eligible and (why := degenerates(options, at, d.candidate.text))
    }
    allowed = selection.guard_eligible([d.eligible for d in drafts], [d.candidate.model in penalised for d in drafts])
    winner = pick_winner(totals, allowed)
    won = drafts[winner].candidate
    stuck = options.guard and (
        won.model in penalised
        or selection.continues_loop(
            at.message, won.text, n=options.guard_ngram, times=options.guard_times, share=options.guard_share
        )
    )
    return Ranking(raw, normalised, list(weights), totals, winner, penalised, stuck)


def alone(drafted: Drafted, leader: Seat) -> Ranking:
    """The leader's draft wins without a vote (the gate passed, or the leader accepted no proposal)."""
    mine = [1.0 if seat is leader else 0.0 for seat, _ in drafted]
    return Ranking({}, {}, mine, mine, mine.index(1.0), {}, False)


def quality_gains(ranking: Ranking, context: GenerationContext) -> list[float]:
    """Each candidate's addition to its author's cumulative quality (Model Exit)."""
    if context.options.exit_votes != "others":
        return list(ranking.totals)
    matrix = list(ranking.scores.values())
    return [selection.cross_quality(matrix, ranking.weights, i) for i in range(len(ranking.totals))]


# --- broadcast, exit, prior ---------------------------------------------------------------


def broadcast(seats: Seats, at: Round, text: str) -> Asking:
    """Every active member's context gets the winning text."""
    chosen = list(seats.active)
    outcomes = yield from seats.ask(chosen, "accept", "accept", lambda s: (text,))
    seats.survivors(chosen, outcomes, at.no, "accept")


def model_exit(seats: Seats, context: GenerationContext, at: Round, keep: Seat | None) -> None:
    """Members whose share of cumulative quality lags leave the query; `keep` (the leader) stays."""
    o, round_no = context.options, at.no
    active = list(seats.active)
    quality = [s.quality for s in active]
    leaving = exit_rule(quality, round_no, ExitRule.of(o))
    for i in leaving:
        if active[i] is not keep:  # the leader is chosen by evidence the votes cannot inflate: it stays
            seats.depart(active[i], round_no, "exit", exit_reason(quality, i, o.exit_temperature))


def prompt_prior(seats: Seats, context: GenerationContext, messages: Sequence[Message]) -> Asking:
    """Voting weights from how well each member predicts the prompt (PackLLM-sim), or None.

    Needs every active member to declare ``prompt_fit``; otherwise None and the
    weights stay as they were (uniform or carried). Returns {name: weight}.
    """
    text = "\n".join(m.content for m in messages if m.role != "assistant").strip()
    chosen = list(seats.active)
    if not text or not all(s.member.capabilities.prompt_fit for s in chosen):
        return None
    outcomes = yield from seats.ask(chosen, "prompt", "text_logprob", lambda s: (text,))
    fits = seats.survivors(chosen, outcomes, 0, "prompt fit")
    for seat, (logprob, n_bytes) in fits:
        seat.bpb = selection.bits_per_byte(logprob, n_bytes) if n_bytes else None
    bpbs = [seat.bpb for seat, _ in fits if seat.bpb is not None]
    if len(bpbs) < len(fits):
        return None
    prior = selection.prompt_weights(bpbs, context.options.prior_temperature)
    return {seat.name: w for (seat, _), w in zip(fits, prior)}
