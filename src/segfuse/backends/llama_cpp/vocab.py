"""A llama.cpp model's vocabulary: tokenizing, token pieces, the special and end-of-generation tokens, and
the templated prompt's tokens (docs/design.md#token-boundaries).

Nothing here decodes; the member, its sessions and its echo read their tokens through it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np
import numpy.typing as npt

from ...errors import MemberLoadError
from ...models import PromptFormat
from ...prompting import chat_prompt, choose_format, raw_prompt, render_chat, render_plain
from ...types import Message
from ..special_text import Special, SpecialTexts, protected_pieces
from ..vocabulary import LocalVocabulary

# Special parsing makes a token of these attributes' texts (user-defined ones are matched either way).
SPECIAL_ATTRS = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN


class Vocabulary(LocalVocabulary):
    """The vocabulary of a loaded model, its chat template and prompt format."""

    def __init__(self, model: Any, name: str, path: Path, prompt: PromptFormat | None) -> None:
        self.name = name
        self._vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = self.vocab_size = lc.llama_vocab_n_tokens(self._vocab)
        template = lc.llama_model_chat_template(model, None)
        self.chat_template = template.decode("utf-8") if template else None
        self.prompt = choose_format(prompt, self.chat_template, path.name)
        self._pieces: dict[int, bytes] = {}
        self.bos = lc.llama_vocab_bos(self._vocab)
        self.eos = lc.llama_vocab_eos(self._vocab)
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))
        self.add_eos = bool(lc.llama_vocab_get_add_eos(self._vocab))
        self.bos_text = self.special_piece(self.bos).decode("utf-8", "replace") if self.bos >= 0 else ""
        self.eos_text = self.special_piece(self.eos).decode("utf-8", "replace") if self.eos >= 0 else ""
        self.eog_ids = self._end_tokens(path)
        self.specials = self._special_texts()

    def _end_tokens(self, path: Path) -> npt.NDArray[np.int64]:
        """Every end-of-generation token (EOS, EOT, <|im_end|>, ...)."""
        is_eog, vocab = lc.llama_vocab_is_eog, self._vocab
        ids = np.array([t for t in range(self.n_vocab) if is_eog(vocab, t)], dtype=np.int64)
        if not len(ids):
            raise MemberLoadError(f"{path.name} declares no end-of-generation token", "use another model file")
        return ids

    def _special_texts(self) -> SpecialTexts:
        """The tokens that special parsing makes of their text, with their whitespace trimming."""
        get_attr, vocab = lc.llama_vocab_get_attr, self._vocab
        attrs = [(t, get_attr(vocab, t)) for t in range(self.n_vocab)]
        return SpecialTexts(
            Special(
                self.special_piece(t).decode("utf-8", "replace"),
                t,
                bool(a & lc.LLAMA_TOKEN_ATTR_LSTRIP),
                bool(a & lc.LLAMA_TOKEN_ATTR_RSTRIP),
            )
            for t, a in attrs
            if a & SPECIAL_ATTRS
        )

    # --- pieces ----------------------------------------------------------------
    def _to_piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def special_piece(self, token: int) -> bytes:
        """A token's text as special parsing reads it (a control token spells its markup)."""
        return self._to_piece(token, True)

    def piece(self, token: int) -> bytes:
        """Text bytes of a token as it appears in an answer (control tokens are empty)."""
        cached = self._pieces.get(token)
        if cached is None:
            cached = b"" if self.is_eog(token) else self._to_piece(token, False)
            self._pieces[token] = cached
        return cached

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self._vocab, token))

    # --- tokenizing ------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (lc.llama_token * capacity)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (lc.llama_token * capacity)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def tokenize_plain(self, text: str) -> list[int]:
        return self.tokenize(text, add_special=False, parse_special=False)

    def lead_tokens(self) -> list[int]:
        return [self.bos] if self.add_bos and self.bos >= 0 else []

    def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
        """The templated prompt's tokens; a message's content never becomes a special token."""
        if (raw := raw_prompt(messages)) is not None:  # a text completion: as llama.cpp's server reads it
            has_bos = bool(self.bos_text) and raw.startswith(self.bos_text)
            return self.tokenize(raw, add_special=not has_bos, parse_special=True)
        if self.prompt.style == "plain":
            return self.tokenize(render_plain(messages), add_special=True, parse_special=False)
        text = self.render(messages)
        has_bos = bool(self.bos_text) and text.startswith(self.bos_text)
        if not self.specials.spelled_in(m.content for m in messages):
            return self.tokenize(text, add_special=not has_bos, parse_special=True)
        return self.protected_tokens(messages, text, add_special=not has_bos)

    def render(self, messages: Sequence[Message]) -> str:
        """`messages` through the model's chat template, ready for the answer (a prefill left open)."""
        template = self.chat_template
        assert template is not None
        return chat_prompt(
            lambda ms, gen: render_chat(template, ms, self.bos_text, self.eos_text, gen), messages, self.name
        )

    def protected_tokens(self, messages: Sequence[Message], text: str, *, add_special: bool) -> list[int]:
        """`text` (the templated `messages`) tokenized with the template's special tokens, and the
        messages' contents as plain text (a content that spells ``<|im_start|>`` stays those characters).
        For ordinary contents the same ids as tokenizing `text` whole (``special_text.py``)."""
        ids = [self.bos] if add_special and self.add_bos else []
        for piece in protected_pieces(self.name, self.render, messages, text, self.specials):
            ids += [piece] if isinstance(piece, int) else self.tokenize(piece, add_special=False, parse_special=False)
        return ids + ([self.eos] if add_special and self.add_eos else [])
