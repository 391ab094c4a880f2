"""``Member.echo`` for a llama.cpp member: a text's tokens read in one pass from its start.

The tokens go into a slot of their own (taken and released like a session's), after the BOS the
model reads first, with no prefix from the cache: the same cells a fresh decode computes, so the
numbers do not depend on what other requests left cached. Rows are read a few at a time (at most
``max_outputs``), so memory stays bounded however long the text.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...types import PromptToken
from ..echo_rows import TextAlternatives, echo_input, echoed, top_of
from .context import Context
from .runtime import LogSoftmax
from .slots import Slots
from .vocab import Vocabulary


def echo_tokens(
    ids: Sequence[int], top_k: int, *, vocab: Vocabulary, ctx: Context, table: Slots, softmax: LogSoftmax
) -> list[PromptToken]:
    """Each of `ids` with its log-probability given those before it (and the BOS) and `top_k` alternatives,
    decoded into a slot of `table` in `ctx`."""
    ids = [int(t) for t in ids]
    tokens, n_lead = echo_input(ids, vocab, ctx.window)
    logprobs: list[float | None] = [None] * len(ids)
    tops: list[TextAlternatives] = [()] * len(ids)
    slot = table.take()
    seq = table.base(slot)
    try:
        step = max(1, min(ctx.n_batch, ctx.max_outputs))
        for at in range(0, len(tokens) - 1, step):
            part = tokens[at : at + step]
            rows = ctx.decode(part, list(range(at, at + len(part))), [seq] * len(part), [True] * len(part))
            for r, row in enumerate(rows):
                target = at + r + 1  # row r predicts the token after part[r]
                if target >= len(tokens):
                    break
                lse = softmax.lse(row)
                i = target - n_lead
                logprobs[i] = float(row[tokens[target]]) - lse
                tops[i] = top_of(row, lse, top_k, vocab.piece)
    finally:
        table.release(slot)
    return echoed(ids, [vocab.piece(t) for t in ids], logprobs, tops)


__all__ = ["echo_tokens"]
