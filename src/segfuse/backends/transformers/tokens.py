"""Token ids <-> exact text bytes for Hugging Face tokenizers.

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
from collections.abc import Callable
from functools import lru_cache
from typing import Any

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
