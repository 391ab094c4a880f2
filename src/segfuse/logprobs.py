"""An answer's log-probabilities, token by token, as each segment's author drafted it.

Every segment keeps the tokens that wrote it (``Segment.trail``): their bytes,
the author's own log-probability of each and, when asked, its most likely
alternatives. Members tokenize differently, so a "token" here is a token of the
member that wrote that part of the answer. Tokens that end inside a multi-byte
character are merged with the next ones (their log-probabilities summed), and a
token a stop string cut is shortened, so the entries' texts join to the answer
exactly.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .segments import complete_utf8_prefix

MAX_TOP_LOGPROBS = 20  # as OpenAI's API

Alternatives = tuple[tuple[bytes, float], ...]  # a position's most likely tokens: (bytes, log-probability)


# What this module reads of an answer's segments (``types.Segment`` and ``types.TokenTrail``), said here
# so that ``types`` can offer ``Result.logprobs()`` without an import circle.
class Trail(Protocol):
    @property
    def pieces(self) -> tuple[bytes, ...]: ...
    @property
    def logprobs(self) -> tuple[float, ...]: ...
    @property
    def tops(self) -> tuple[Alternatives, ...]: ...


class Written(Protocol):
    @property
    def text(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def trail(self) -> Trail | None: ...


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token: its text and bytes, its author's log-probability and alternatives."""

    text: str
    bytes: bytes
    logprob: float
    top: tuple[tuple[str, builtins.bytes, float], ...]  # builtins: `bytes` here is the field above
    model: str  # the member that wrote it


def answer_logprobs(segments: Sequence[Written]) -> list[TokenLogprob]:
    """Every token of the answer the segments spell, in order; texts join to the answer."""
    entries: list[TokenLogprob] = []
    for segment in segments:
        entries += _segment_tokens(segment)
    return entries


def _segment_tokens(segment: Written) -> list[TokenLogprob]:
    want = segment.text.encode("utf-8")
    trail = segment.trail
    pieces, logprobs, tops = (trail.pieces, trail.logprobs, trail.tops) if trail is not None else ((), (), ())
    out: list[TokenLogprob] = []
    done = 0  # bytes of `want` covered so far
    pending, logprob, first_top = b"", 0.0, None
    for i, piece in enumerate(pieces):
        if done + len(pending) >= len(want):
            break
        if not pending:
            first_top = tops[i] if i < len(tops) else ()
        pending += piece
        logprob += logprobs[i]
        pending = pending[: len(want) - done]  # a stop string may have cut this token
        if complete_utf8_prefix(pending) == len(pending) and pending:
            out.append(_entry(pending, logprob, first_top or (), segment.model))
            done += len(pending)
            pending, logprob = b"", 0.0
    if done < len(want):  # never expected: the trail always spells its text; keep the join exact anyway
        rest = want[done:]
        out.append(TokenLogprob(rest.decode("utf-8", errors="replace"), rest, logprob, (), segment.model))
    return out


def _entry(data: bytes, logprob: float, top: Alternatives, model: str) -> TokenLogprob:
    alternatives = tuple((b.decode("utf-8", errors="replace"), b, lp) for b, lp in top)
    return TokenLogprob(data.decode("utf-8"), data, logprob, alternatives, model)


__all__ = ["MAX_TOP_LOGPROBS", "TokenLogprob", "answer_logprobs"]
