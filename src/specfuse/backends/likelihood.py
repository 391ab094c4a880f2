"""How likely a member finds given continuations of one context, over the session protocol.

One session holds the context (a ``raw`` prompt: no chat template); every continuation is
scored on its cached cells, a few distinct texts per ``score`` call (a llama.cpp session
verifies at most :data:`MAX_PER_CALL` candidates at once, in at most ``n_batch`` tokens).
A group a backend refuses as too large is halved; a single text still too large is scored
in pieces on a session of its own, each piece accepted before the next is scored, as the
engine scores segments. Nothing here depends on one backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PromptTooLongError
from ..types import Message, TokenScores
from .base import Member, MemberSession

MAX_PER_CALL = 7
"""Distinct texts asked for in one ``score`` call (llama.cpp's candidate sequences per round)."""

SCORE_PIECE_BYTES = 400
"""A text too long for one scoring batch is scored in pieces of at most this many UTF-8 bytes
(cut before whitespace), in order on the growing context."""

GREEDY_TOLERANCE = 1e-6  # a token is the greedy one when its log-probability is its row's maximum


@dataclass(frozen=True)
class ContinuationScore:
    """One member's verdict on one continuation: summed natural-log probability of its tokens,
    how many tokens and UTF-8 bytes it spans, and whether every token was the member's greedy
    choice (None where the backend does not report its top tokens)."""

    logprob: float
    tokens: int
    bytes: int
    greedy: bool | None

    @property
    def per_byte(self) -> float:
        return self.logprob / max(self.bytes, 1)


def summarise(text: str, scores: TokenScores) -> ContinuationScore:
    """A text's token scores as one :class:`ContinuationScore`."""
    greedy = None
    if scores.tops is not None:
        greedy = all(lp >= top - GREEDY_TOLERANCE for lp, top in zip(scores.logprobs, scores.tops))
    return ContinuationScore(float(sum(scores.logprobs)), len(scores.logprobs), len(text.encode("utf-8")), greedy)


def score_continuations(member: Member, context: str, texts: Sequence[str]) -> list[ContinuationScore]:
    """`member`'s score of each text after `context` (a raw prompt, cached once), in order.

    Raises PromptTooLongError when the context, or the context and a text, do not fit the
    member's window.
    """
    messages = [Message("raw", context)]
    found: dict[str, TokenScores] = {}
    too_long: list[str] = []
    distinct = list(dict.fromkeys(texts))
    session = member.start(messages, seed=None, reserve=1)
    try:
        for at in range(0, len(distinct), MAX_PER_CALL):
            _score_group(session, distinct[at : at + MAX_PER_CALL], found, too_long)
    finally:
        session.close()  # before opening another: a member may hold one session at a time
    for text in too_long:
        found[text], _ = score_in_pieces(member, messages, text)
    return [summarise(t, found[t]) for t in texts]


def _score_group(session: MemberSession, group: list[str], found: dict[str, TokenScores],
                 too_long: list[str]) -> None:
    """Score `group` in one call, or its halves when the backend refuses it as too large."""
    try:
        found.update(zip(group, session.score(group)))
    except (PromptTooLongError, ValueError):
        if len(group) == 1:
            too_long.append(group[0])
        else:
            half = len(group) // 2
            session.accept("")  # drop whatever the refused call laid out
            _score_group(session, group[:half], found, too_long)
            _score_group(session, group[half:], found, too_long)
    finally:
        session.accept("")  # the context stays; this call's candidates are dropped


def score_in_pieces(member: Member, messages: Sequence[Message], text: str) -> tuple[TokenScores, int]:
    """Score a long `text` piece by piece on a growing context; returns (scores, calls)."""
    pieces = split_for_scoring(text)
    logprobs: list[float] = []
    logits: list[float] = []
    tops: list[float] | None = []
    session = member.start(messages, seed=None, reserve=1)
    try:
        for piece in pieces:
            scores = session.score([piece])[0]
            logprobs += scores.logprobs
            logits += scores.logits
            tops = None if tops is None or scores.tops is None else tops + list(scores.tops)
            session.accept(piece)
    finally:
        session.close()
    return TokenScores(tuple(logprobs), tuple(logits), None if tops is None else tuple(tops)), len(pieces)


def split_for_scoring(text: str, limit: int = SCORE_PIECE_BYTES) -> list[str]:
    """Cut `text` into pieces of at most `limit` UTF-8 bytes, before whitespace when possible.

    Bytes, not characters: a token spells at least one byte, so a piece is at
    most `limit` tokens in any vocabulary (a 400-character piece of CJK text or
    emoji can be 1,200 tokens).
    """
    if not text:
        return [""]
    pieces: list[str] = []
    while len(text.encode("utf-8")) > limit:
        cut = len(text.encode("utf-8")[:limit].decode("utf-8", "ignore"))  # characters within the limit
        at = max(text.rfind(" ", 1, cut), text.rfind("\n", 1, cut))
        at = at if at > 0 else max(cut, 1)
        pieces.append(text[:at])
        text = text[at:]
    pieces.append(text)
    return pieces
