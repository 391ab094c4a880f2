"""Cutting drafts into segments: whole words, whole characters, stop strings.

A draft is a list of token pieces (bytes). Cuts happen at token boundaries so
that the kept tokens are exactly a prefix of what the member drafted; that lets
the member reuse its own log-probabilities and KV cache for the kept text.

Rule (docs/design.md#draft, applied at token granularity):
- a finished draft (end-of-generation) is kept whole;
- if the text ends in a letter or digit, the last word may be incomplete: cut
  before the last token that starts with whitespace (unless that leaves nothing);
- if it ends in punctuation or whitespace, keep it, except trailing tokens that
  are only spaces/tabs, which belong to the next word's token;
- never end inside a multi-byte UTF-8 character.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Cut:
    """The kept prefix of a draft: `n_tokens` tokens that decode to `text`."""

    text: str
    n_tokens: int


def complete_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not end inside a character."""
    end = len(data)
    # A UTF-8 character is at most 4 bytes: only the last 3 can be an unfinished start.
    for back in range(1, min(4, end) + 1):
        byte = data[end - back]
        if byte < 0x80:
            return end  # ASCII: everything before is complete
        if byte >= 0xC0:  # lead byte: does its character fit?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return end if back >= need else end - back
    return end


def _ends_mid_word(text: str) -> bool:
    return bool(text) and text[-1].isalnum()


def _starts_word(piece: bytes) -> bool:
    return piece[:1] in (b" ", b"\t", b"\n", b"\r")


def _only_blanks(piece: bytes) -> bool:
    return bool(piece) and not piece.strip(b" \t")


def _utf8_safe_count(pieces: Sequence[bytes], n: int) -> int:
    """Largest k <= n such that pieces[:k] ends on a character boundary."""
    while n > 0:
        data = b"".join(pieces[:n])
        if complete_utf8_prefix(data) == len(data):
            return n
        n -= 1
    return 0


def cut_draft(pieces: Sequence[bytes], finished: bool, whole_words: bool = True) -> Cut:
    """Cut a draft back to a whole-word (unless not `whole_words`), whole-character boundary."""
    n = len(pieces)
    if not finished:
        n = _utf8_safe_count(pieces, n)
    if not finished and whole_words:
        text = b"".join(pieces[:n]).decode("utf-8", errors="replace")
        if _ends_mid_word(text):
            for k in range(n - 1, 0, -1):
                if _starts_word(pieces[k]):
                    n = k
                    break
        while n > 1 and _only_blanks(pieces[n - 1]):
            n -= 1
        n = _utf8_safe_count(pieces, n)
    text = b"".join(pieces[:n]).decode("utf-8", errors="replace")
    return Cut(text=text, n_tokens=n)


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest stop string in `text` that ends past `start` (it may begin before), or -1."""
    hits = [i for s in stops if s and (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(hits) if hits else -1


def apply_stops(answer: str, candidate: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Truncate `candidate` where a stop string appears in `answer + candidate`.

    Only stops that end inside the candidate count (earlier text was already
    checked, or is a prefill, whose own stop strings do not end the answer); one that
    begins in `answer` keeps nothing of the candidate. Returns the kept candidate text
    and whether a stop was hit.
    """
    if not stops or not candidate:
        return candidate, False
    longest = max(len(s) for s in stops)
    tail = answer[-(longest - 1) :] if longest > 1 else ""
    joined = tail + candidate
    at = find_stop(joined, stops, len(tail))
    if at < 0:
        return candidate, False
    return joined[:at][len(tail) :] if at >= len(tail) else "", True


def tokens_spelling(pieces: Sequence[bytes], text: str) -> int | None:
    """Smallest k such that pieces[:k] spell `text` exactly, else None.

    Backends use it to recognise their own draft (or a prefix of it) as the winner.
    """
    target = text.encode("utf-8")
    joined = b""
    for k, piece in enumerate(pieces):
        if joined == target:
            return k
        joined += piece
    return len(pieces) if joined == target else None


def tokens_covering(pieces: Sequence[bytes], n_bytes: int) -> int:
    """How many leading pieces it takes to cover `n_bytes` bytes (a stop cut inside a token)."""
    covered = count = 0
    while covered < n_bytes and count < len(pieces):
        covered += len(pieces[count])
        count += 1
    return count


def _blank(piece: str) -> bool:
    return bool(piece) and not piece.strip(" \t")


def sure_prefix(pieces: Sequence[str], answer: str, stops: Sequence[str]) -> str:
    """Of a draft still being written, the text its segment keeps however the draft goes on.

    `pieces` is the draft's text so far, cut where its tokens ended (one or more tokens a piece;
    whole characters). :func:`cut_draft` may cut an unfinished draft before its last token that
    starts with whitespace (after the first) and drop blank tokens before that: so the sure part ends
    before the last such piece, less the blank pieces ahead of it. A piece that hides a token start
    hides one that begins inside a character, never a word, so a coarser view only keeps less.
    Then :func:`before_stops`: nothing a stop string may yet start or end.
    """
    k = next((i for i in range(len(pieces) - 1, 0, -1) if pieces[i][:1] in (" ", "\t", "\n", "\r")), len(pieces))
    while k > 1 and _blank(pieces[k - 1]):
        k -= 1
    return before_stops(answer, "".join(pieces[:k]), stops)


def before_stops(answer: str, text: str, stops: Sequence[str]) -> str:
    """`text` up to a stop string it completes after `answer`, less any tail that could begin one
    (as llama.cpp's server holds back a partial stop): what may be shown before the draft ends."""
    kept, hit = apply_stops(answer, text, stops)
    if hit or not stops:
        return kept
    joined = answer + kept
    hold = 0
    for stop in stops:
        for j in range(min(len(stop) - 1, len(joined)), hold, -1):
            if joined.endswith(stop[:j]):
                hold = j
                break
    return kept[: len(kept) - min(hold, len(kept))]
