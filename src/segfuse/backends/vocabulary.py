"""A local member's vocabulary as its sessions, its echo and its constraints use it.

Each local backend reads its tokenizer its own way (``llama_cpp/vocab.py``, ``transformers/tokens.py``) and
supplies the pieces, plain-text tokens, the templated prompt and the end-of-generation tokens; what follows
from them is here: token ids checked, continuations that spell a text exactly, and the token-level matcher
of a constraint (docs/design.md#token-boundaries).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..constraints import Constraint, TokenMatcher, tokenizer_for
from ..errors import InvalidRequestError
from ..types import Message


class LocalVocabulary(ABC):
    """A tokenizer that is here: token ids <-> exact text bytes, and the model's special tokens."""

    name: str  # the member's, as errors quote it
    n_vocab: int  # ids with a text (logits rows past it, where there are any, are padding)
    vocab_size: int  # rows of its logits
    eog_ids: Sequence[int] | npt.NDArray[np.int64]  # its end-of-generation tokens
    _matcher_tokenizer: Any = None  # the constraint tokenizer over every piece, read once

    @abstractmethod
    def tokenize_plain(self, text: str) -> list[int]:
        """Ids of plain text: no special tokens added, special-token markup taken literally."""

    @abstractmethod
    def piece(self, token: int) -> bytes:
        """Text bytes of a token as it appears in an answer (control tokens are empty)."""

    @abstractmethod
    def is_eog(self, token: int) -> bool:
        """Whether `token` ends a generation."""

    @abstractmethod
    def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
        """The templated prompt's tokens."""

    @abstractmethod
    def lead_tokens(self) -> list[int]:
        """The tokens the model reads before a text (its BOS, where it uses one)."""

    def check_ids(self, ids: Sequence[int]) -> None:
        """InvalidRequestError naming the first id outside the vocabulary (a native tokenizer given one
        may abort the process)."""
        bad = next((t for t in ids if not 0 <= int(t) < self.n_vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is not in {self.name}'s vocabulary (0 to {self.n_vocab - 1})",
                "give ids of this member's tokenizer (see /tokenize)",
                field="prompt",
            )

    def detokenize(self, tokens: Sequence[int]) -> str:
        self.check_ids(tokens)
        return b"".join(self.piece(int(t)) for t in tokens).decode("utf-8", "replace")

    def spells(self, ids: Sequence[int], text: str) -> bool:
        return b"".join(self.piece(t) for t in ids) == text.encode("utf-8")

    def encode_continuation(self, text: str) -> list[int]:
        """Tokens that spell exactly `text` when appended to a context.

        SentencePiece-style vocabularies may add a leading-space marker to a
        text tokenized alone; anchoring on a newline avoids it.
        """
        ids = self.tokenize_plain(text)
        if self.spells(ids, text):
            return ids
        anchor, joined = self.tokenize_plain("\n"), self.tokenize_plain("\n" + text)
        if joined[: len(anchor)] == anchor and self.spells(joined[len(anchor) :], text):
            return joined[len(anchor) :]
        return ids

    def matcher(self, constraint: Constraint, prefill: str = "") -> TokenMatcher:
        """A matcher of `constraint` over these tokens, after `prefill` (the vocabulary is read once, ~1 s)."""
        if self._matcher_tokenizer is None:
            pieces = [self._piece_or_empty(t) for t in range(self.vocab_size)]
            self._matcher_tokenizer = tokenizer_for(pieces, [int(t) for t in self.eog_ids], self.tokenize_plain)
        return TokenMatcher(self._matcher_tokenizer, constraint, self.vocab_size, prefill)

    def _piece_or_empty(self, token: int) -> bytes:
        try:
            return self.piece(token)
        except (IndexError, KeyError, ValueError, TypeError):  # padding rows past the tokenizer's own tokens
            return b""
