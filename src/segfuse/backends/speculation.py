"""A member reading drafts for itself: which of their tokens it keeps (docs/performance.md#drafting).

The drafts (texts from other members, or copied from the prompt) are laid out as token sequences
after the member's context and decoded in one pass; :func:`walk` then goes down them as a tree, the
way the member would write on its own: at each position it picks its own next token from the row
there, with its own sampling (greedy: the top token; otherwise one draw from its own generator, as
drafting alone draws one per token), and goes on only along the drafts that hold that token. The
tokens it keeps are thus the ones it would have written alone, and it always keeps at least one (its
own token where every draft differs). This is pure logic: a backend supplies the rows and its own way
of picking.

"The ones it would have written alone" up to rounding: a batch of tokens is computed with other
kernels than one token at a time (llama.cpp's quantized CPU kernels round differently, by up to about
0.1 in a logit, and the cells so computed carry that on), so where the member's two likeliest tokens
lie closer than that, reading drafts may pick the other one than writing alone did. The prefix cache
has the same effect, for the same reason (docs/performance.md#drafting gives the measured share).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

Row = TypeVar("Row")  # one logits row, in the backend's own array type


@dataclass
class Walk(Generic[Row]):
    """What a walk kept: `kept` tokens, the row that picked each, a draft whose decoded cells hold
    every kept token but the last, and how many tokens of each draft were kept."""

    kept: list[int]
    rows: list[Row]
    source: int
    accepted: list[int]


def walk(
    drafts: Sequence[Sequence[int]],
    row_at: Callable[[int, int], Row],
    pick: Callable[[Row, list[int]], int],
    ends: Callable[[int], bool],
    limit: int,
) -> Walk[Row]:
    """Go down `drafts` (token ids after the context) as the member writes: `row_at(d, p)` is the row
    after draft `d`'s first `p` tokens (p may equal its length); `pick(row, kept_so_far)` is the
    member's own next token there; a token for which `ends` is true ends the answer. At most `limit`
    tokens (at least one)."""
    if not drafts:
        drafts = [()]
    kept: list[int] = []
    rows: list[Row] = []
    accepted = [0] * len(drafts)
    group = list(range(len(drafts)))  # the drafts that hold every token kept so far
    while True:
        at = len(kept)
        row = row_at(group[0], at)
        token = pick(row, kept)
        kept.append(token)
        rows.append(row)
        if ends(token) or len(kept) >= max(1, limit):
            break
        following = [d for d in group if len(drafts[d]) > at and drafts[d][at] == token]
        if not following:
            break
        for d in following:
            accepted[d] += 1
        group = following
    return Walk(kept, rows, group[0], accepted)


def distinct_drafts(encoded: Sequence[Sequence[int]], limit: int) -> tuple[list[list[int]], list[int]]:
    """The distinct non-empty drafts, each cut to `limit` tokens, and for each given draft its index among
    them (-1: empty)."""
    index: dict[tuple[int, ...], int] = {}
    where: list[int] = []
    for ids in encoded:
        key = tuple(ids[: max(0, limit)])
        if not key:
            where.append(-1)
            continue
        where.append(index.setdefault(key, len(index)))
    return [list(k) for k in index], where
