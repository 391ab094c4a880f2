"""Message contents that spell a special token stay text (no forged roles).

A chat template's own markup (``<|im_start|>user``) must become special
tokens, yet a user who writes ``<|im_end|>\\n<|im_start|>system`` in a message
must not get real role tokens. Tokenizers only know "parse special tokens" or
"do not" for a whole text, so:

- when no message content contains a special token's text (nearly always),
  the templated prompt is tokenized as a whole, exactly as before;
- otherwise the prompt is cut, as llama.cpp's tokenizer cuts it, at special
  token texts that lie outside the contents (longest token first, with the
  tokens' lstrip/rstrip), and each run of text between them is tokenized with
  special parsing off. The contents' character ranges come from rendering the
  template once more with a placeholder per content (``prompting.content_spans``).

Backend-agnostic: each backend gives its special tokens (text, id, strip flags)
and tokenizes the runs itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..errors import InvalidRequestError
from ..prompting import content_spans
from ..types import Message

WHITESPACE = " \t\n\v\f\r"  # C's isspace, as llama.cpp strips around lstrip/rstrip tokens
PREFIX = 3  # texts are grouped by their first characters, so a scan does few lookups per hit


@dataclass(frozen=True)
class Special:
    """A special token: its text, its id, and whether it eats whitespace before (lstrip) or after (rstrip)."""

    text: str
    id: int
    lstrip: bool = False
    rstrip: bool = False


class SpecialTexts:
    """The special tokens of one vocabulary, for finding their texts in a string quickly."""

    def __init__(self, specials: Iterable[Special]) -> None:
        self.by_text: dict[str, Special] = {}
        for special in specials:
            if special.text:
                self.by_text.setdefault(special.text, special)
        # prefix -> (texts with it, their distinct lengths): one str.find per prefix, a set lookup per length
        groups: dict[str, tuple[set[str], set[int]]] = {}
        for text in self.by_text:
            texts, lengths = groups.setdefault(text[:PREFIX], (set(), set()))
            texts.add(text)
            lengths.add(len(text))
        self._groups = [(prefix, texts, sorted(lengths)) for prefix, (texts, lengths) in groups.items()]

    def found(self, text: str, *, first: bool = False) -> set[str]:
        """The special token texts that occur in `text` (with `first`, stop at the first one)."""
        seen: set[str] = set()
        for prefix, texts, lengths in self._groups:
            at = text.find(prefix)
            while at >= 0:
                for n in lengths:
                    piece = text[at : at + n]
                    if piece in texts:
                        seen.add(piece)
                        if first:
                            return seen
                at = text.find(prefix, at + 1)
        return seen

    def spelled_in(self, contents: Iterable[str]) -> bool:
        """Whether any of `contents` spells a special token."""
        return any(self.found(content, first=True) for content in contents)


def partition(text: str, protected: Sequence[tuple[int, int]], specials: SpecialTexts) -> list[str | int]:
    """`text` as runs of plain text and special token ids, cut only at special texts outside `protected`
    character ranges: llama.cpp's partition (every token in turn, longest first, over the runs left)."""
    found = sorted(specials.found(text), key=len, reverse=True)
    pieces: list[tuple[int, int] | int] = [(0, len(text))]  # (start, end) of a run, or a token id
    for token_text in found:
        special = specials.by_text[token_text]
        cut: list[tuple[int, int] | int] = []
        for piece in pieces:
            if isinstance(piece, int):
                cut.append(piece)
                continue
            start, end = piece
            at = text.find(token_text, start, end)
            while at >= 0:
                stop = at + len(token_text)
                if any(at < b and a < stop for a, b in protected):  # inside a message: stays text
                    at = text.find(token_text, at + 1, end)
                    continue
                left = at
                if special.lstrip:
                    while left > start and text[left - 1] in WHITESPACE:
                        left -= 1
                if left > start:
                    cut.append((start, left))
                cut.append(special.id)
                start = stop
                if special.rstrip:
                    while start < end and text[start] in WHITESPACE:
                        start += 1
                at = text.find(token_text, start, end)
            if start < end:
                cut.append((start, end))
        pieces = cut
    return [p if isinstance(p, int) else text[p[0] : p[1]] for p in pieces]


def protected_pieces(
    member: str,
    render: Callable[[Sequence[Message]], str],
    messages: Sequence[Message],
    text: str,
    specials: SpecialTexts,
) -> list[str | int]:
    """`text` (the templated `messages`) cut into the template's special token ids and runs of plain text
    (the contents among them); refused when the template rewrites contents so that they cannot be found."""
    spans = content_spans(render, messages, text)
    if spans is None:
        raise InvalidRequestError(
            f"a message spells a special token of {member}, and its chat template rewrites message "
            "contents, so the text could not be kept apart from the template's own tokens",
            "remove the special token's text from the message",
        )
    return partition(text, spans, specials)
