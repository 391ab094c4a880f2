"""A transformers member's vocabulary: token ids <-> exact text bytes, the templated prompt's tokens, and
the end-of-generation and special tokens (docs/design.md#token-boundaries).

The engine cuts drafts on token pieces as bytes (a character may be split
across tokens), so decoding each token to a ``str`` is not enough. The fast
tokenizer's decoder says how its vocabulary spells bytes:
- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): each character of a token
  stands for one byte through the GPT-2 byte table;
- SentencePiece style (Llama 2, Gemma): ``▁`` is a space and ``<0xNN>`` is a
  raw byte (byte fallback).
Other decoders fall back to decoding each token alone (exact for ASCII).
Control tokens (BOS, EOS, chat markers) spell nothing, as in llama.cpp.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from ...errors import MemberLoadError
from ...models import PromptFormat
from ...prompting import chat_prompt, choose_format, raw_prompt, render_plain
from ...types import Message
from ..special_text import Special, SpecialTexts, protected_pieces
from ..vocabulary import LocalVocabulary

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-ins for all 256 bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _decoder_kinds(tokenizer: Any) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        kinds.add(str(node.get("type")))
        if node.get("type") == "Replace" and node.get("pattern", {}).get("String") == "▁":
            kinds.add("Metaspace")
        for child in node.get("decoders") or []:
            walk(child)

    walk(decoder)
    return kinds


def control_ids(tokenizer: Any) -> set[int]:
    """Special tokens: they spell nothing in an answer."""
    ids = {int(i) for i in tokenizer.all_special_ids}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    return ids


def _spell_byte_level(token: str) -> bytes:
    table = _gpt2_byte_decoder()
    try:
        return bytes(table[c] for c in token)
    except KeyError:  # an added (non-byte-level) token: its text as written
        return token.encode("utf-8")


def _spell_sentencepiece(token: str) -> bytes:
    match = _BYTE_TOKEN.match(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def piece_function(tokenizer: Any) -> Callable[[int], bytes]:
    """A function token id -> the bytes it adds to a text (b"" for control tokens)."""
    control = control_ids(tokenizer)
    kinds = _decoder_kinds(tokenizer)
    spell: Callable[[str], bytes] | None = None
    if "ByteLevel" in kinds:
        spell = _spell_byte_level
    elif "ByteFallback" in kinds or "Metaspace" in kinds:
        spell = _spell_sentencepiece
    cache: dict[int, bytes] = {}

    def piece(token_id: int) -> bytes:
        found = cache.get(token_id)
        if found is None:
            if token_id in control:
                found = b""
            elif spell is not None:
                found = spell(tokenizer.convert_ids_to_tokens(token_id))
            else:  # unknown vocabulary style: exact for whole characters only
                found = tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
            cache[token_id] = found
        return found

    return piece


def text_frame(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The tokens `tokenizer` puts before and after a text (BOS, EOS), read off a one-word text."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    framed = tokenizer("a", add_special_tokens=True)["input_ids"]
    at = next((i for i in range(len(framed)) if framed[i : i + len(bare)] == bare), 0)
    return list(framed[:at]), list(framed[at + len(bare) :])


class Vocabulary(LocalVocabulary):
    """A Hugging Face tokenizer, its chat template and prompt format, and the model's end tokens.

    `vocab_size`: the rows of the model's logits; `generation_eos`: the end-of-generation id(s) of the
    model's generation config, beside the tokenizer's EOS."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str,
        prompt: PromptFormat | None,
        vocab_size: int,
        generation_eos: int | Sequence[int] | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.chat_template: str | None = getattr(tokenizer, "chat_template", None)
        self.prompt = choose_format(prompt, self.chat_template, name)
        self._piece = piece_function(tokenizer)
        self.n_vocab = len(tokenizer)  # ids with a text (logits rows past it are padding)
        self.vocab_size = vocab_size
        self.text_prefix, self.text_suffix = text_frame(tokenizer)  # e.g. its BOS; EOS
        self.eog_ids = self._end_tokens(generation_eos)
        self._eog_set = frozenset(self.eog_ids)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.specials = SpecialTexts(
            Special(str(t.content), int(i), bool(getattr(t, "lstrip", False)), bool(getattr(t, "rstrip", False)))
            for i, t in added.items()
            if getattr(t, "special", False)
        )

    def _end_tokens(self, generation_eos: int | Sequence[int] | None) -> list[int]:
        """Every end-of-generation id the model declares (generation config and tokenizer)."""
        eog: set[int] = set()
        for ids in (generation_eos, self.tokenizer.eos_token_id):
            eog.update([ids] if isinstance(ids, int) else list(ids or []))
        if not eog:
            raise MemberLoadError(f"{self.name} declares no end-of-generation token", "fix its tokenizer config")
        return sorted(eog)

    def is_eog(self, token: int) -> bool:
        return token in self._eog_set

    def tokenize_plain(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def piece(self, token: int) -> bytes:
        return self._piece(token)

    def lead_tokens(self) -> list[int]:
        return list(self.text_prefix)

    def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
        tok = self.tokenizer
        if (raw := raw_prompt(messages)) is not None:  # a text completion: no template, specials parsed (as llama.cpp)
            return list(tok(raw, add_special_tokens=not (tok.bos_token and raw.startswith(tok.bos_token)))["input_ids"])
        if self.prompt.style == "plain":  # contents only: special token texts in them stay text
            return list(tok(render_plain(messages), add_special_tokens=True, split_special_tokens=True)["input_ids"])
        text = self.render(messages)
        has_bos = bool(tok.bos_token) and text.startswith(tok.bos_token)
        if not self.specials.spelled_in(m.content for m in messages):
            return list(tok(text, add_special_tokens=not has_bos)["input_ids"])
        return self.protected_tokens(messages, text, add_special=not has_bos)

    def render(self, messages: Sequence[Message]) -> str:
        """`messages` through the tokenizer's chat template, ready for the answer (a prefill left open)."""
        return chat_prompt(
            lambda ms, gen: self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in ms], tokenize=False, add_generation_prompt=gen
            ),
            messages,
            self.name,
        )

    def protected_tokens(self, messages: Sequence[Message], text: str, *, add_special: bool) -> list[int]:
        """`text` (the templated `messages`) tokenized with the template's special tokens, and the
        messages' contents as plain text (``split_special_tokens``; see ``special_text.py``)."""
        tok = self.tokenizer
        ids: list[int] = []
        for piece in protected_pieces(self.name, self.render, messages, text, self.specials):
            ids += (
                [piece]
                if isinstance(piece, int)
                else tok(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            )
        return self.text_prefix + ids + self.text_suffix if add_special else ids
