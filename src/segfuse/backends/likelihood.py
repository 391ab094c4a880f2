"""How likely a member finds given continuations of one context, over the session protocol.

One session holds the context (a ``raw`` prompt: no chat template); every continuation is
scored on its cached cells, a few distinct texts per ``score`` call (a llama.cpp session
verifies at most :data:`MAX_PER_CALL` candidates at once, in at most ``n_batch`` tokens).
A group a backend refuses as too large is halved; a single text still too large is scored
in pieces on a session of its own, each piece accepted before the next is scored, as the
engine scores segments. Several items are scored at once (``score_batches``) where a member
batches sessions: one session per item, up to its ``slots``, their groups in one ``score_many``.
Nothing here depends on one backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import PromptTooLongError
from ..prompting import raw_prompt
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
    outcome = score_batches(member, [(context, texts)])[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def batch_width(member: Member) -> int:
    """How many items `member` scores at once: its free slots where it batches sessions, else one
    (a slot another request holds is not waited for, but by a batch of one)."""
    if not member.capabilities.batched:
        return 1
    slots = member.slots or 1
    free = member.occupancy().free_slots
    return max(min(slots, slots if free is None else free), 1)


def score_batches(
    member: Member, items: Sequence[tuple[str, Sequence[str]]]
) -> list[list[ContinuationScore] | Exception]:
    """:func:`score_continuations` for several (context, texts) items: up to :func:`batch_width`
    sessions open at once, one per item, their groups of texts scored together through
    ``member.score_many``. Each item's outcome in order: its scores, or the exception it met."""
    width = batch_width(member)
    out: list[list[ContinuationScore] | Exception] = []
    for at in range(0, len(items), width):
        out += _score_batch(member, items[at : at + width])
    return out


@dataclass
class _Item:
    """One item of a batch: its session, the groups of texts still to score, what is known."""

    context: str
    texts: Sequence[str]
    queue: list[list[str]]
    session: MemberSession | None = None
    found: dict[str, TokenScores] = field(default_factory=dict)
    too_long: list[str] = field(default_factory=list)
    error: Exception | None = None


def _score_batch(
    member: Member, items: Sequence[tuple[str, Sequence[str]]]
) -> list[list[ContinuationScore] | Exception]:
    batch = [_Item(context, texts, _groups(texts)) for context, texts in items]
    try:
        for item in batch:  # each item's own failure (a context over the window) is that item's
            try:
                item.session = member.start([Message("raw", item.context)], seed=None, reserve=1)
            except Exception as exc:  # the item's own failure, not the batch's
                item.error = exc
        while live := [(i, i.session) for i in batch if i.queue and i.error is None and i.session is not None]:
            groups = [i.queue.pop(0) for i, _ in live]
            outcomes = member.score_many([session for _, session in live], [(g,) for g in groups])
            for (item, session), group, outcome in zip(live, groups, outcomes):
                _take(item, session, group, outcome)
    finally:
        for item in batch:  # before opening another: a member may hold one session at a time
            if item.session is not None:
                _close(item, item.session)
    return [_finish(member, item) for item in batch]


def _groups(texts: Sequence[str]) -> list[list[str]]:
    distinct = list(dict.fromkeys(texts))
    return [distinct[at : at + MAX_PER_CALL] for at in range(0, len(distinct), MAX_PER_CALL)]


def _take(item: _Item, session: MemberSession, group: list[str], outcome: list[TokenScores] | Exception) -> None:
    """Keep a group's scores; a group the backend refused as too large is halved (queued first),
    a single text set aside to be scored in pieces; any other failure is the item's."""
    try:
        session.accept("")  # the context stays; the candidates are dropped
    except Exception as exc:  # a session that cannot go on fails its item alone
        item.error = exc
        return
    if not isinstance(outcome, Exception):
        item.found.update(zip(group, outcome))
    elif not isinstance(outcome, (PromptTooLongError, ValueError)):
        item.error = outcome
    elif len(group) == 1:
        item.too_long.append(group[0])
    else:
        half = len(group) // 2
        item.queue[:0] = [group[:half], group[half:]]


def _close(item: _Item, session: MemberSession) -> None:
    try:
        session.close()
    except Exception as exc:  # the other sessions must still be closed
        item.error = item.error or exc


def _finish(member: Member, item: _Item) -> list[ContinuationScore] | Exception:
    """The item's scores, its long texts scored in pieces now that its batch's sessions are closed."""
    if item.error is not None:
        return item.error
    try:
        for text in item.too_long:
            item.found[text], _ = score_in_pieces(member, [Message("raw", item.context)], text)
    except Exception as exc:  # the item's own failure
        return exc
    return [summarise(t, item.found[t]) for t in item.texts]


def score_in_pieces(member: Member, messages: Sequence[Message], text: str) -> tuple[TokenScores, int]:
    """Score a long `text` piece by piece on a growing context; returns (scores, calls).

    After a raw context (a text, no template), a text longer than the member's window is read in
    rolling windows: when the next piece would not fit, the session starts again on the last half
    window of the text so far (in bytes, so at most that many tokens), and scoring goes on there.
    """
    pieces = split_for_scoring(text)
    logprobs: list[float] = []
    logits: list[float] = []
    tops: list[float] | None = []
    raw, read = raw_prompt(messages), ""
    session = member.start(messages, seed=None, reserve=1)
    try:
        for piece in pieces:
            if raw is not None and session.room <= len(piece.encode("utf-8")):
                session.close()
                session = member.start([Message("raw", _tail(raw + read, _window(member)))], seed=None, reserve=1)
            scores = session.score([piece])[0]
            logprobs += scores.logprobs
            logits += scores.logits
            tops = None if tops is None or scores.tops is None else tops + list(scores.tops)
            session.accept(piece)
            read += piece
    finally:
        session.close()
    return TokenScores(tuple(logprobs), tuple(logits), None if tops is None else tuple(tops)), len(pieces)


def _window(member: Member) -> int:
    """The member's window in tokens (its ``n_ctx``)."""
    n_ctx = getattr(member, "n_ctx", None)
    if not isinstance(n_ctx, int) or n_ctx < 4 * SCORE_PIECE_BYTES:
        raise PromptTooLongError(
            f"{member.name}: the text does not fit its context window, and the window "
            f"is too small to read it in rolling windows of {SCORE_PIECE_BYTES} bytes",
            "shorten the text, or load the member with a larger n_ctx",
        )
    return n_ctx


def _tail(text: str, window: int) -> str:
    """The last half `window` of `text` in UTF-8 bytes (at most that many tokens), from a whitespace."""
    data = text.encode("utf-8")[-(window // 2) :]
    tail = data.decode("utf-8", "ignore")
    cut = min((i for i in (tail.find(" "), tail.find("\n")) if i >= 0), default=-1)
    return tail[cut:] if 0 <= cut < len(tail) // 2 else tail


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
