"""What a generation's steps share: what stays the same for all of it, and where a round starts.

:class:`GenerationContext` is made once per generation from its :class:`~segfuse.request.FusionRequest`
(the options, the sampling with the log-probabilities asked, the constraint and its matcher, the
deadline, the cache salt) and handed to the lineup and the phases. :class:`Round` is where one
round starts: its number, the answer so far and the tokens left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ..backends.base import Member
from ..constraints import Constraint, TextMatcher
from ..options import FusionOptions
from ..request import FusionRequest
from ..types import Candidate, Sampling


@dataclass(frozen=True)
class GenerationContext:
    """The constants of one generation, made from its request (:meth:`of`)."""

    options: FusionOptions
    sampling: Sampling  # the options' own, with the request's top log-probabilities
    constraint: Constraint | None
    matcher: TextMatcher | None  # the constraint over the answer's bytes (it keeps its place: one per generation)
    deadline: float | None  # time.monotonic(): no round starts after it
    cache_salt: str | None

    @classmethod
    def of(cls, request: FusionRequest) -> GenerationContext:
        constraint = request.constraint
        return cls(
            request.options,
            replace(request.options.sampling, top_logprobs=request.top_logprobs),
            constraint,
            TextMatcher(constraint) if constraint is not None else None,
            request.deadline,
            request.cache_salt,
        )

    @property
    def top_logprobs(self) -> int:
        """How many likeliest tokens each drafter reports per position."""
        return self.sampling.top_logprobs

    @property
    def start_options(self) -> dict[str, object]:
        """What members start their sessions with besides the prompt; only what is set, so that a member's
        ``start`` need not know about salts or determinism otherwise."""
        given: dict[str, object] = {} if self.cache_salt is None else {"cache_salt": self.cache_salt}
        if self.options.deterministic:
            given["deterministic"] = True
        return given

    def passed_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def drafts(self, member: Member) -> bool:
        """Whether `member` drafts: under a constraint, only members that can draft under it (the others verify)."""
        return self.constraint is None or member.capabilities.constrained

    def check(self, answer: str, candidate: Candidate) -> str | None:
        """Why `candidate` may not win after `answer` under the constraint (None: it may, or there is none)."""
        if self.matcher is None:
            return None
        if not self.matcher.allows(answer, candidate.text):
            return "breaks the constraint"
        if candidate.finished and not self.matcher.complete(answer + candidate.text):
            return "ends an incomplete answer"
        return None


@dataclass(frozen=True)
class Round:
    """Where a round starts: its number, the whole message so far (the prefill and the answer: what stop
    strings, the constraint and the guard read), the last segment's text, and the tokens the answer
    may still take."""

    no: int
    message: str
    last: str = ""
    budget: int = 0


__all__ = ["GenerationContext", "Round"]
