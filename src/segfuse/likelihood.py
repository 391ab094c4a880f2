"""Log-likelihoods of given continuations: every member scores every choice, the scores are pooled.

Members tokenize differently, so their scores are compared per continuation (``whole``: the
summed log-probability) or per UTF-8 byte of it (``byte``), never per token. Two pools:

- ``loglinear``: the weighted mean of the members' values, a product of experts (it
  decomposes over tokens, so it can be attributed to any member's tokens);
- ``mixture``: the weighted mean of the members' probabilities, each member's values first
  normalised over the item's choices (a softmax), so it exists only for a whole item.

Weights are uniform unless given (``segfuse calibrate --scores`` fits them on your items).
The context is tokenized as lm-eval does: a trailing whitespace of the context moves to the
start of each continuation. An empty context is scored after a newline (the member's BOS
before it where it uses one), as ``loglikelihood_rolling`` needs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .backends.base import Member
from .backends.likelihood import ContinuationScore, batch_width, score_batches
from .errors import InvalidRequestError, PromptTooLongError

MAX_CHOICES = 100
EMPTY_CONTEXT = "\n"  # what an empty context is scored after
Pooling = Literal["loglinear", "mixture"]  # how the members' probabilities are pooled
Norm = Literal["byte", "whole"]
POOLS: tuple[Pooling, ...] = ("loglinear", "mixture")
NORMS: tuple[Norm, ...] = ("byte", "whole")
RULES = tuple(f"{p}-{n}" for p in POOLS for n in NORMS)


@dataclass(frozen=True)
class Rule:
    """A pooling rule: the pool, the unit compared, and the members' weights (None: uniform)."""

    pool: Pooling = "loglinear"
    norm: Norm = "byte"
    weights: Mapping[str, float] | None = None

    @classmethod
    def parse(cls, name: str, weights: Mapping[str, float] | None = None) -> Rule:
        """``loglinear-byte``, ``loglinear-whole``, ``mixture-byte`` or ``mixture-whole``."""
        pool, _, norm = name.strip().lower().partition("-")
        if pool not in POOLS or norm not in NORMS:
            raise InvalidRequestError(f"unknown pooling rule {name!r}", f"choose one of {', '.join(RULES)}")
        return cls(pool, norm, weights)

    @property
    def name(self) -> str:
        return f"{self.pool}-{self.norm}"

    def member_weights(self, names: Sequence[str]) -> dict[str, float]:
        """The weights of `names`, summing to 1 (uniform where none are given)."""
        given = {n: float((self.weights or {}).get(n, 0.0 if self.weights else 1.0)) for n in names}
        if any(w < 0 or not math.isfinite(w) for w in given.values()):
            raise InvalidRequestError("pooling weights must be finite and not negative", f"got {given}")
        total = sum(given.values())
        if total <= 0:
            raise InvalidRequestError("the pooling weights of these members sum to 0", f"got {given}")
        return {n: w / total for n, w in given.items()}

    def value(self, score: ContinuationScore) -> float:
        return score.per_byte if self.norm == "byte" else score.logprob

    def fuse(self, scores: Mapping[str, Sequence[ContinuationScore]]) -> list[float]:
        """The pooled score of each choice from every member's scores of the choices."""
        weights = self.member_weights(list(scores))
        values = {n: [self.value(s) for s in row] for n, row in scores.items()}
        n_choices = len(next(iter(values.values())))
        if self.pool == "loglinear":
            return [sum(weights[n] * values[n][i] for n in values) for i in range(n_choices)]
        logs = {n: log_softmax(row) for n, row in values.items()}
        return [
            logsumexp([math.log(weights[n]) + logs[n][i] for n in logs if weights[n] > 0]) for i in range(n_choices)
        ]


def weight_pairs(pairs: Sequence[str], sep: str, what: str, hint: str) -> dict[str, float]:
    """``NAME<sep>WEIGHT`` pairs as a mapping; a malformed pair is refused as a bad `what`, saying `hint`."""
    weights = {}
    for pair in pairs:
        name, found, value = pair.rpartition(sep)
        try:
            weights[name] = float(value)
        except ValueError:
            found = ""
        if not found or not name:
            raise InvalidRequestError(f"bad {what} {pair!r}", hint)
    return weights


def log_softmax(values: Sequence[float]) -> list[float]:
    total = logsumexp(values)
    return [v - total for v in values]


def logsumexp(values: Sequence[float]) -> float:
    peak = max(values)
    return peak + math.log(sum(math.exp(v - peak) for v in values))


@dataclass
class ItemScores:
    """Every member's scores of an item's choices, the pooled scores and the time each member took."""

    context: str
    choices: list[str]  # as scored: a trailing whitespace of the context moved to their start
    members: dict[str, list[ContinuationScore]]
    seconds: dict[str, float] = field(default_factory=dict)
    rule: Rule = field(default_factory=Rule)
    fused: list[float] = field(default_factory=list)

    @property
    def best(self) -> int:
        """The index of the choice the pooled scores prefer (the first on a tie)."""
        return max(range(len(self.fused)), key=self.fused.__getitem__)

    def member_best(self, name: str, norm: Norm = "byte") -> int:
        row = [Rule(norm=norm).value(s) for s in self.members[name]]
        return max(range(len(row)), key=row.__getitem__)

    def pooled(self, rule: Rule) -> list[float]:
        return rule.fuse(self.members)


def split_boundary(context: str, continuations: Sequence[str]) -> tuple[str, list[str]]:
    """(context, continuations) as scored: the context's trailing whitespace starts every
    continuation (lm-eval's rule), and an empty context becomes :data:`EMPTY_CONTEXT`."""
    kept = context.rstrip()
    moved = context[len(kept) :]
    return kept or EMPTY_CONTEXT, [moved + c for c in continuations]


def check_item(context: str, continuations: Sequence[str]) -> None:
    """Refuse what cannot be scored, naming it."""
    if not isinstance(context, str) or any(not isinstance(c, str) for c in continuations):
        raise InvalidRequestError("the context and the choices must be strings", "pass text")
    if not continuations:
        raise InvalidRequestError("no choices given", "pass at least one continuation to score")
    if len(continuations) > MAX_CHOICES:
        raise InvalidRequestError(f"{len(continuations)} choices given", f"score at most {MAX_CHOICES} at once")
    for i, text in enumerate(continuations):
        if not text:
            raise InvalidRequestError(f"choice {i} is empty", "every continuation needs at least one character")


def score_item(
    members: Sequence[Member], context: str, continuations: Sequence[str], rule: Rule | None = None
) -> ItemScores:
    """Every member's score of every continuation after `context`, and their pool under `rule`."""
    outcome = score_items(members, [(context, continuations)], rule)[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def score_items(
    members: Sequence[Member], items: Sequence[tuple[str, Sequence[str]]], rule: Rule | None = None
) -> list[ItemScores | Exception]:
    """:func:`score_item` for several (context, continuations) items, in order: each item's scores,
    or the error it met (bad input, a context over a member's window), which is that item's alone.

    Members that batch sessions score up to their ``slots`` items at once, their choices in one
    decode; the seconds a member spent on a batch are shared evenly by its items."""
    rule = rule or Rule()
    out: list[ItemScores | Exception] = []
    for context, continuations in items:
        try:
            check_item(context, continuations)
        except InvalidRequestError as exc:
            out.append(exc)
            continue
        scored_context, texts = split_boundary(context, continuations)
        out.append(ItemScores(scored_context, texts, {}, {}, rule))
    for member in members:
        _score_with(member, out)
    for item in out:
        if isinstance(item, ItemScores):
            item.fused = rule.fuse(item.members)
    return out


def _score_with(member: Member, out: list[ItemScores | Exception]) -> None:
    """Add `member`'s scores to every item still standing in `out`; an item it fails becomes its error."""
    live = [(at, item) for at, item in enumerate(out) if isinstance(item, ItemScores)]
    width = batch_width(member)
    for start in range(0, len(live), width):
        batch = live[start : start + width]
        began = time.perf_counter()
        outcomes = score_batches(member, [(item.context, item.choices) for _, item in batch])
        share = (time.perf_counter() - began) / len(batch)
        for (at, item), outcome in zip(batch, outcomes):
            if isinstance(outcome, Exception):
                out[at] = _named(member, outcome)
            else:
                item.members[member.name] = outcome
                item.seconds[member.name] = share


def _named(member: Member, error: Exception) -> Exception:
    """A context or choice over `member`'s window, said with its name."""
    if not isinstance(error, PromptTooLongError):
        return error
    named = PromptTooLongError(
        f"{member.name}: {error.message}", "shorten the context or the choices, or raise the member's n_ctx"
    )
    named.__cause__ = error
    return named
