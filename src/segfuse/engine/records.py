"""What a round decided and what it teaches: the decision, the voting weights, the round's record.

``loop.Generation._round`` returns a :class:`Decision` (how the winner was
chosen, and everything the choice used); :func:`round_record` turns it into the
:class:`~segfuse.types.RoundRecord` that is streamed and kept; :class:`Votes`
holds the voting weights and what votes teach (Hedge, the guard's patience,
Model Exit's quality).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..types import RoundRecord
from . import phases
from .context import GenerationContext, Round
from .phases import Drafted, Ranking
from .seats import Seat

How = Literal["confident", "alone", "drafted", "rejected", "vote"]


@dataclass(kw_only=True)
class Decision:
    """How a round's winner was chosen: "confident" (the gate passed), "alone" (the leader answers
    alone, accept_margin 0), "drafted" (the leader answers alone, reading drafts: ``drafted.py``),
    "rejected" (the leader accepted no proposal), "vote"."""

    how: How
    drafted: Drafted
    ranking: Ranking
    leader: Seat | None
    confidence: float | None
    calls_before: int  # the seats' call count when the round began
    consulted: dict[str, str] = field(default_factory=dict)  # proposal author -> the leader's verdict

    @property
    def gated(self) -> bool:
        """The leader's draft won without a vote."""
        return self.how in ("confident", "alone", "drafted")

    @property
    def winner(self) -> phases.Draft:
        return self.drafted[self.ranking.winner][1]


def gated_how(confidence: float | None, context: GenerationContext) -> How:
    """How the leader's draft won alone: with the gate's confidence, or because it answers alone."""
    options = context.options
    confident = confidence is not None and options.gate is not None and confidence >= options.gate
    return "confident" if confident else "alone"


class Votes:
    """The voting weights (Hedge carried across queries) and the guard's patience."""

    def __init__(self, names: Sequence[str], start: Mapping[str, float] | None) -> None:
        given = dict(start or {})
        mean = sum(given.values()) / len(given) if given else 1.0 / len(names)
        self.weights = {name: given.get(name, mean) for name in names}
        self.hopeless = 0  # votes in a row whose winner still looped (guard patience)

    def normalised(self, names: Sequence[str]) -> list[float]:
        values = [self.weights[n] for n in names]
        total = sum(values)
        return [v / total for v in values] if total > 0 else [1.0 / len(names)] * len(names)

    def learn(self, drafted: Drafted, ranking: Ranking, context: GenerationContext) -> None:
        """What a vote teaches: Hedge's weights, the guard's patience, Model Exit's quality."""
        if context.options.hedge:
            self.weights.update(zip([seat.name for seat, _ in drafted], ranking.weights))
        self.hopeless = self.hopeless + 1 if ranking.stuck else 0
        for (seat, _), gain in zip(drafted, phases.quality_gains(ranking, context)):
            seat.quality += gain


def round_record(at: Round, decision: Decision, votes: Votes, calls_now: int) -> RoundRecord:
    """The record of a decided round (departures and its total time are added at its end)."""
    d, ranking = decision, decision.ranking
    names = [seat.name for seat, _ in d.drafted]
    weights = votes.normalised(names) if d.how == "rejected" else ranking.weights
    return RoundRecord(
        index=at.no,
        active=names,
        candidates=[draft.candidate for _, draft in d.drafted],
        raw_scores=ranking.raw,
        scores=ranking.scores,
        weights=dict(zip(names, weights)),
        aggregate=ranking.totals,
        winner_index=ranking.winner,
        model_calls=calls_now - d.calls_before,
        gated=d.gated,
        leader=d.leader.name if d.leader is not None else None,
        confidence=d.confidence,
        penalised=ranking.penalised,
        draft_s={s.name: s.timings.get("draft", 0.0) for s, _ in d.drafted},
        verify_s={} if d.gated else {s.name: s.timings.get("verify", 0.0) for s, _ in d.drafted},
        consulted=d.consulted,
        decision=d.how,
    )
