"""A text's tokens as every member reads it, pooled onto one member's tokens (an echoed prompt).

Members tokenize differently, so the pool is written on the tokens of one of them (the *reader*:
the leader for the ensemble). Each member's log-probabilities are summed onto the reader's token
whose bytes hold that member token's last byte, and the reader's entry carries the weighted mean of
the members' sums (log-linear pooling, weights summing to one). Summing the entries of a stretch
that starts and ends on a token boundary of every member gives that stretch's pooled log-likelihood
(``loglinear-whole``). A token's alternatives are the reader's own, moved by the same amount as its
token's entry, so the entry is the likeliest exactly when the reader's token is its greedy choice.
See docs/design.md#echo-a-texts-tokens-as-every-member-reads-it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .backends.base import Member
from .errors import InvalidRequestError
from .types import PromptToken


def attribute(reader: Sequence[PromptToken], other: Sequence[PromptToken]) -> list[float | None]:
    """`other`'s log-probabilities summed per `reader` token (by the token holding each one's last
    byte); None where no member token with a log-probability ends inside it."""
    sums: list[float | None] = [None] * len(reader)
    at = 0
    for token in other:
        if token.logprob is None or token.end <= 0:
            continue
        while at < len(reader) - 1 and reader[at].end < token.end:
            at += 1
        sums[at] = (sums[at] or 0.0) + token.logprob
    return sums


def pool(
    reader: str, read: Mapping[str, Sequence[PromptToken]], weights: Mapping[str, float] | None = None
) -> list[PromptToken]:
    """The `reader`'s tokens with the members' weighted mean log-probability each (uniform weights
    unless given); every member's tokens in `read` spell the same text."""
    names = list(read)
    given = {n: max(0.0, float((weights or {}).get(n, 1.0))) for n in names}
    total = sum(given.values()) or float(len(names))
    share = {n: (given[n] / total if sum(given.values()) else 1.0 / len(names)) for n in names}
    own = read[reader]
    columns = {n: attribute(own, read[n]) for n in names}
    pooled = []
    for i, token in enumerate(own):
        parts = [(share[n], lp) for n in names if (lp := columns[n][i]) is not None]
        if token.logprob is None or not parts:
            pooled.append(PromptToken(token.id, token.text, token.start, token.end, None, token.top))
            continue
        value = sum(w * lp for w, lp in parts)
        shift = value - token.logprob
        pooled.append(
            PromptToken(
                token.id, token.text, token.start, token.end, value, tuple((text, lp + shift) for text, lp in token.top)
            )
        )
    return pooled


__all__ = ["attribute", "pool"]


def reader_of(members: Sequence[Member], named: str | None = None) -> Member:
    """Whose tokens an echo is written on: the member `named`, else the largest (as the leader is
    chosen), else the first."""
    if named is not None:
        for member in members:
            if member.name == named:
                return member
    sizes = [n for m in members if isinstance(n := m.n_params, int) and n > 0]
    if len(sizes) == len(members):
        return members[max(range(len(members)), key=lambda i: sizes[i])]
    return members[0]


def echo_text(
    members: Sequence[Member],
    prompt: str | Sequence[int],
    *,
    top_k: int = 0,
    reader: str | None = None,
    weights: Mapping[str, float] | None = None,
) -> tuple[Member, list[PromptToken]]:
    """Every member reads `prompt` (a text, or token ids of the reader's vocabulary); the reader and
    the pooled tokens (one member: its own). Raises InvalidRequestError for a member that cannot echo."""
    unable = [m.name for m in members if not m.capabilities.echo]
    if unable:
        raise InvalidRequestError(
            f"member {unable[0]} cannot report a prompt's log-probabilities",
            "ask for a member that can (llama.cpp members can), or drop echo",
        )
    first = reader_of(members, reader)
    if isinstance(prompt, str):
        text = prompt
    else:
        text = first.detokenize(prompt) or ""
    read = {first.name: first.echo(prompt if not isinstance(prompt, str) else text, top_k)}
    for member in members:
        if member is not first:
            read[member.name] = member.echo(text, 0)
    return first, pool(first.name, read, weights) if len(members) > 1 else read[first.name]
