"""Plain data passed between the engine, the backends and the interfaces."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeGuard, get_args

from .logprobs import Alternatives as Alternatives  # re-exported: a member's bytes-keyed alternatives
from .logprobs import TokenLogprob, answer_logprobs

# "raw": a text completion's prompt, read by every member as it is (no chat template, no format)
Role = Literal["system", "user", "assistant", "raw"]
ROLES: tuple[Role, ...] = get_args(Role)


def is_role(value: object) -> TypeGuard[Role]:
    """Whether `value` is one of the message roles."""
    return value in ROLES


@dataclass(frozen=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True)
class Sampling:
    """How a member drafts. temperature 0 means greedy."""

    temperature: float = 0.6
    top_p: float = 0.9
    seed: int | None = None
    ignore_eos: bool = False  # never sample end-of-generation tokens (benchmarks)
    top_logprobs: int = 0  # report this many of the drafter's most likely tokens at each position
    # A draft ends after a token the drafter itself gives less than this probability (drafting for a leader:
    # what follows an unsure token is seldom kept; assisted generation's confidence threshold). 0: never.
    stop_below: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class DraftTokens:
    """What a backend returns from drafting: raw token pieces with their scores.

    `pieces` are the detokenized bytes of each token (b"" for end-of-generation
    tokens), `logprobs`/`logits` the member's own log-probability and raw logit
    of each sampled token (temperature 1, unfiltered), `finished` whether the
    last token ended the answer. ``tops``: with ``Sampling.top_logprobs``, the
    member's most likely tokens (bytes, log-probability) at each position, where
    the backend can tell.
    """

    pieces: tuple[bytes, ...]
    logprobs: tuple[float, ...]
    logits: tuple[float, ...]
    finished: bool
    tops: tuple[Alternatives, ...] = ()


@dataclass(frozen=True)
class Speculation:
    """What a member kept of drafts it verified for itself (``MemberSession.speculate``): the tokens it
    would have written on its own (``tokens``: the longest prefix of any draft that its own decoding
    reproduces, then its own next token), and for each draft how many of its tokens it kept, of how many
    (in its own tokenization)."""

    tokens: DraftTokens
    accepted: tuple[int, ...]
    proposed: tuple[int, ...]


@dataclass(frozen=True)
class TokenTrail:
    """The tokens that wrote a text, as its author drafted them (for ``logprobs``): their bytes,
    the author's log-probability of each, and its most likely alternatives where asked for."""

    pieces: tuple[bytes, ...]
    logprobs: tuple[float, ...]
    tops: tuple[Alternatives, ...] = ()


@dataclass(frozen=True)
class TokenScores:
    """A verifier's per-token log-probabilities and raw logits for one text.

    ``tops``, where the backend reports them, are the log-probabilities of the
    verifier's own most likely token at each position (what it would have
    written there greedily): the leader's acceptance test compares with them.
    """

    logprobs: tuple[float, ...]
    logits: tuple[float, ...]
    tops: tuple[float, ...] | None = None


TextAlternatives = tuple[tuple[str, float], ...]  # an echoed position's most likely tokens: (text, log-probability)


@dataclass(frozen=True)
class PromptToken:
    """One token of a text a member read (an echoed prompt): its id, the characters it completes
    (the entries' texts join to the text exactly; a token ending inside a character spells none of it),
    the UTF-8 byte span it covers, its log-probability given the tokens before it (None for the
    first: nothing predicts it), and the member's most likely tokens there as (text, log-probability)."""

    id: int | None
    text: str
    start: int
    end: int
    logprob: float | None
    top: TextAlternatives = ()


@dataclass(frozen=True)
class Candidate:
    """A member's draft after cutting to a word/character boundary."""

    model: str
    text: str
    finished: bool
    n_tokens: int
    trail: TokenTrail | None = field(default=None, repr=False, compare=False)  # the tokens that wrote `text`


@dataclass(frozen=True)
class Segment:
    """An accepted piece of the answer and the member that wrote it."""

    text: str
    model: str
    round: int
    trail: TokenTrail | None = field(default=None, repr=False, compare=False)  # the tokens that wrote `text`


DepartureKind = Literal["exit", "fault"]


@dataclass(frozen=True)
class Departure:
    """A member that stopped taking part in a query: Model Exit or a fault."""

    model: str
    round: int
    kind: DepartureKind
    reason: str


@dataclass
class RoundRecord:
    """Everything that happened in one round, for inspection and JSON output.

    ``active`` lists the members that drafted and verified in this round, in
    candidate order; ``scores[verifier]`` are that verifier's normalised scores
    of the candidates in the same order; ``weights`` are the voting weights used.
    """

    index: int
    active: list[str]
    candidates: list[Candidate]
    raw_scores: dict[str, list[float | None]]
    scores: dict[str, list[float]]
    weights: dict[str, float]
    aggregate: list[float]
    winner_index: int
    model_calls: int = 0
    departures: list[Departure] = field(default_factory=list)
    gated: bool = False  # the leader's confident draft was accepted without a vote
    leader: str | None = None  # the member that drafted first under the gate
    confidence: float | None = None  # the leader's own mean token probability of its draft
    penalised: dict[str, str] = field(default_factory=dict)  # candidate author -> why it could not win
    consulted: dict[str, str] = field(default_factory=dict)  # proposal author -> the leader's verdict and why
    # how the winner was decided: "confident" (the gate passed), "alone" (the leader answers alone,
    # accept_margin 0), "drafted" (the leader alone, reading drafts), "rejected" (the leader accepted no
    # proposal), "vote"
    decision: str = "vote"
    drafts: dict[str, list[int]] = field(default_factory=dict)  # drafted rounds: drafter -> [proposed, kept]
    draft_s: dict[str, float] = field(default_factory=dict)
    verify_s: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0

    @property
    def winner(self) -> str:
        """The member whose candidate won."""
        return self.candidates[self.winner_index].model

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["winner"] = self.winner
        for candidate in data["candidates"]:
            del candidate["trail"]  # per-token detail: the answer's logprobs carry it
        return data


@dataclass
class Stats:
    rounds: int = 0
    gated_rounds: int = 0  # rounds the leader's draft won alone (confidence gate)
    model_calls: int = 0
    tokens: int = 0
    wins: dict[str, int] = field(default_factory=dict)
    time_to_first_segment_s: float | None = None
    total_s: float = 0.0
    finish_reason: str = ""
    # With drafting on: drafter -> rounds it drafted, tokens it proposed, tokens the leader kept of them.
    drafting: dict[str, dict[str, int]] = field(default_factory=dict)
    # With drafting on: rounds the leader wrote without drafts because more answers were in flight together
    # than FusionOptions.draft_users.
    crowded_rounds: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def calls_per_round(self) -> float:
        return self.model_calls / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tokens_per_s"] = round(self.tokens_per_s, 3)
        data["calls_per_round"] = round(self.calls_per_round, 3)
        return data


@dataclass
class Result:
    """The fused answer with its provenance. After a prefill (a final assistant message), `text` is the
    continuation alone."""

    text: str
    segments: list[Segment]
    rounds: list[RoundRecord]
    stats: Stats
    models: list[str]
    departures: list[Departure] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)  # voting weights at the end
    counters: dict[str, dict[str, int]] = field(default_factory=dict)  # backend work per member
    prompt_bpb: dict[str, float] = field(default_factory=dict)  # members' bits per byte on the prompt
    # Under a constraint (structured output): whether the finished answer (after a prefill, the prefill
    # and the answer) satisfies it (None: no constraint, or the answer was cut short), and why not.
    valid: bool | None = None
    invalid_reason: str | None = None

    def logprobs(self) -> list[TokenLogprob]:
        """Each answer token's log-probability under the member that wrote it (``segfuse.logprobs``)."""
        return answer_logprobs(self.segments)

    def to_dict(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "invalid_reason": self.invalid_reason,
            "prompt_bpb": self.prompt_bpb,
            "text": self.text,
            "models": self.models,
            "segments": [{"text": s.text, "model": s.model, "round": s.round} for s in self.segments],
            "rounds": [r.to_dict() for r in self.rounds],
            "departures": [asdict(d) for d in self.departures],
            "weights": self.weights,
            "counters": self.counters,
            "stats": self.stats.to_dict(),
        }


@dataclass(frozen=True)
class SegmentEvent:
    """Emitted as soon as a round's winner is known: stream `segment.text` now.

    When the leader answers alone, its text comes as it decodes: ``partial`` events carry the new
    text of the round's segment (no token trail: the answer's log-probabilities are in the result),
    and the event at the round's end carries what is left of it (none when nothing is). Every
    event's text is new text: joined, they are the answer.
    """

    segment: Segment
    partial: bool = False


@dataclass(frozen=True)
class RoundEvent:
    """Emitted at the end of each round with its full record."""

    record: RoundRecord


@dataclass(frozen=True)
class DoneEvent:
    """The last event of a stream; carries the complete result."""

    result: Result


Event = SegmentEvent | RoundEvent | DoneEvent
