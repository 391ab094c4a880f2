"""Turning a member's logits rows over a text's tokens into echoed tokens (``Member.echo``): each
token's log-probability, its row's likeliest alternatives, and the characters each token completes.
Nothing here depends on one backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..errors import PromptTooLongError
from ..segments import complete_utf8_prefix
from ..types import PromptToken, TextAlternatives
from .vocabulary import LocalVocabulary


def echo_input(ids: Sequence[int], vocab: LocalVocabulary, window: int) -> tuple[list[int], int]:
    """The tokens an echo of `ids` decodes (its BOS first where `ids` lacks it) and how many come before
    `ids`; a clear error for an id outside `vocab` or a text over the context `window`."""
    vocab.check_ids(ids)
    lead = vocab.lead_tokens()
    bos = lead if lead and list(ids[: len(lead)]) != lead else []
    tokens = bos + list(ids)
    if len(tokens) > window:
        raise PromptTooLongError(
            f"{vocab.name}: the text is {len(tokens)} tokens, over its context window ({window})",
            "shorten the text",
        )
    return tokens, len(bos)


def top_of(row: np.ndarray, lse: float, k: int, piece: Callable[[int], bytes]) -> TextAlternatives:
    """The `k` likeliest tokens of `row` as (text, log-probability), likeliest first (one entry per text)."""
    if k <= 0:
        return ()
    ids = np.argpartition(-row, min(k, len(row) - 1))[: k * 2]  # a few spare: two tokens may share a text
    ids = ids[np.argsort(-row[ids], kind="stable")]
    table: dict[str, float] = {}
    for token in ids:
        table.setdefault(piece(int(token)).decode("utf-8", "replace"), float(row[token]) - lse)
        if len(table) == k:
            break
    return tuple(table.items())


def echoed(
    ids: Sequence[int], pieces: Sequence[bytes], logprobs: Sequence[float | None], tops: Sequence[TextAlternatives]
) -> list[PromptToken]:
    """One entry per token: its byte span and the whole characters it completes, so that the
    entries' texts join to the decoded text exactly."""
    out: list[PromptToken] = []
    data, shown = b"", 0  # bytes so far; of them, bytes already spelled by an entry's text
    for token, piece, logprob, top in zip(ids, pieces, logprobs, tops):
        start = len(data)
        data += piece
        whole = complete_utf8_prefix(data)
        out.append(PromptToken(token, data[shown:whole].decode("utf-8", "replace"), start, len(data), logprob, top))
        shown = whole
    if shown < len(data) and out:  # a text ending inside a character: its last entry spells the rest
        last = out[-1]
        out[-1] = PromptToken(
            last.id, last.text + data[shown:].decode("utf-8", "replace"), last.start, last.end, last.logprob, last.top
        )
    return out


__all__ = ["TextAlternatives", "echoed", "top_of"]
