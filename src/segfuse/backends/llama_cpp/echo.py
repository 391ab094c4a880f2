"""``Member.echo`` for a llama.cpp member: a text's tokens read in one pass from its start.

The tokens go into a slot of their own (taken and released like a session's), after the BOS the
model reads first, with no prefix from the cache: the same cells a fresh decode computes, so the
numbers do not depend on what other requests left cached. Rows are read a few at a time (at most
``max_outputs``), so memory stays bounded however long the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...errors import PromptTooLongError
from ...types import PromptToken
from ..echo_rows import Alternatives, echoed, top_of

if TYPE_CHECKING:
    from .member import LlamaCppMember


def echo_tokens(m: LlamaCppMember, ids: Sequence[int], top_k: int) -> list[PromptToken]:
    """Each of `ids` with its log-probability given those before it (and the BOS) and `top_k` alternatives."""
    ids = [int(t) for t in ids]
    m.check_ids(ids)
    lead = m.lead_tokens()
    bos = lead if lead and list(ids[: len(lead)]) != lead else []
    tokens = bos + list(ids)
    if len(tokens) > m.n_ctx:
        raise PromptTooLongError(f"{m.name}: the text is {len(tokens)} tokens, over its context window "
                                 f"({m.n_ctx})", "shorten the text")
    logprobs: list[float | None] = [None] * len(ids)
    tops: list[Alternatives] = [()] * len(ids)
    slot = m.table.take()
    seq = m.table.base(slot)
    try:
        step = max(1, min(m.n_batch, m.max_outputs))
        for at in range(0, len(tokens) - 1, step):
            part = tokens[at : at + step]
            rows = m.decode(part, list(range(at, at + len(part))), [seq] * len(part), [True] * len(part))
            for r, row in enumerate(rows):
                target = at + r + 1  # row r predicts the token after part[r]
                if target >= len(tokens):
                    break
                lse = m.softmax.lse(row)
                i = target - len(bos)
                logprobs[i] = float(row[tokens[target]]) - lse
                tops[i] = top_of(row, lse, top_k, m.piece)
    finally:
        m.release(slot)
    return echoed(ids, [m.piece(t) for t in ids], logprobs, tops)


__all__ = ["echo_tokens"]
