"""``Member.echo`` for a transformers member: a text's tokens read in one pass from its start.

The tokens run on a ``DynamicCache`` of their own (after the tokens the tokenizer puts before a text,
its BOS, which are not echoed), with no prefix from the member's cache: the same numbers a fresh
decode computes. They run in chunks whose logits rows stay within :data:`ROW_FLOATS` floats, so
memory is bounded however long the text and however large the vocabulary. Like the member's
sessions, an echo owns its cache and shares only the weights, so it needs no lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from ...types import PromptToken
from ..echo_rows import TextAlternatives, echo_input, echoed, top_of
from .tokens import Vocabulary
from .weights import Weights

ROW_FLOATS = 2**25
"""Logits floats held at once (128 MiB in float32): a chunk has ROW_FLOATS // vocabulary rows."""

MAX_CHUNK = 512  # tokens per forward at most, however small the vocabulary


def echo_tokens(ids: Sequence[int], top_k: int, *, vocab: Vocabulary, weights: Weights) -> list[PromptToken]:
    """Each of `ids` with its log-probability given those before it (and the BOS) and `top_k` alternatives."""
    ids = [int(t) for t in ids]
    tokens, n_lead = echo_input(ids, vocab, weights.n_ctx)

    def spelled(token: int) -> bytes:  # a logits row's token; b"" past the tokenizer's vocabulary (padding rows)
        return vocab.piece(token) if token < vocab.n_vocab else b""

    logprobs: list[float | None] = [None] * len(ids)
    tops: list[TextAlternatives] = [()] * len(ids)
    step = max(1, min(MAX_CHUNK, ROW_FLOATS // max(weights.vocab_size, 1)))
    cache = DynamicCache()
    for at in range(0, len(tokens) - 1, step):  # the last token predicts nothing echoed
        part = tokens[at : at + step]
        rows = weights.forward(cache, part, range(at, at + len(part)))
        targets = tokens[at + 1 : at + 1 + len(part)]  # row r predicts the token after part[r]
        rows = rows[: len(targets)]
        lse = torch.logsumexp(rows, dim=-1)
        picked = rows.gather(1, torch.tensor(targets, device=rows.device)[:, None])[:, 0] - lse
        table = rows.cpu().numpy() if top_k > 0 else None
        for r, logprob in enumerate(picked.tolist()):
            i = at + r + 1 - n_lead
            logprobs[i] = logprob
            if table is not None:
                tops[i] = top_of(table[r], float(lse[r]), top_k, spelled)
        del rows, table
    return echoed(ids, [vocab.piece(t) for t in ids], logprobs, tops)


__all__ = ["MAX_CHUNK", "ROW_FLOATS", "echo_tokens"]
