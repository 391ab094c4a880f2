"""Reading OpenAI-style completion responses: choices, per-token log-probabilities, and which
tokens spell which characters (the text <-> tokens bookkeeping a remote member needs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...types import TokenScores
from .http import RemoteServerError


@dataclass(frozen=True)
class Entry:
    token: str
    offset: int
    logprob: float | None
    top: float | None = None  # log-prob of the most likely token at this position, where the server lists it


def entries_of(logprobs: dict[str, Any] | None) -> list[Entry]:
    """The tokens of a choice's `logprobs`, checked; offsets rebuilt from token texts where missing."""
    if not logprobs or not isinstance(logprobs.get("tokens"), list):
        raise RemoteServerError(
            "the server returned no per-token log-probabilities", "it must support `logprobs` on /v1/completions"
        )
    tokens = logprobs["tokens"]
    lps = logprobs.get("token_logprobs") or [None] * len(tokens)
    offsets = logprobs.get("text_offset")
    if not offsets or len(offsets) != len(tokens):  # rebuild from token texts
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
    alternatives = logprobs.get("top_logprobs") or [None] * len(tokens)
    entries = [
        Entry(str(t), int(o), None if lp is None else float(lp), _top(lp, alt))
        for t, o, lp, alt in zip(tokens, offsets, lps, alternatives)
    ]
    for entry in entries:
        # A log-probability is finite and at most 0; allow float noise above 0.
        if entry.logprob is not None and not (math.isfinite(entry.logprob) and entry.logprob <= 1e-3):
            raise RemoteServerError(f"the server returned a nonsense log-probability {entry.logprob!r}", "")
    return entries


def _top(logprob: Any, alternatives: Any) -> float | None:
    """The best log-probability at a position: the listed alternatives' and the token's own."""
    if not isinstance(alternatives, dict) or not alternatives or logprob is None:
        return None
    try:
        return max(float(logprob), *(float(v) for v in alternatives.values()))
    except (TypeError, ValueError):
        return None


def pieces_of(text: str, entries: Sequence[Entry], *, generated: bool = False) -> list[str]:
    """Split `text` into one piece per token, using the offsets.

    A character split across tokens belongs to the token that completes it
    (offsets count whole characters), so pieces never hold half a character.
    In `generated` text a token the text leaves out (a special token vLLM lists
    but skips in the text, while its offsets still count it) gets an empty piece.
    """
    if not entries:
        return []
    base = entries[0].offset
    bounds = [min(max(e.offset - base, 0), len(text)) for e in entries] + [len(text)]
    pieces = [text[bounds[i] : max(bounds[i], bounds[i + 1])] for i in range(len(entries))]
    spelled = all(_spells(e, p, e.offset - base >= len(text)) for e, p in zip(entries, pieces))
    if "".join(pieces) != text or not spelled:  # offsets unusable: align the token texts on the text
        return _align([e.token for e in entries], text, generated)
    return _carry_split_characters(entries, pieces)


def _spells(entry: Entry, piece: str, past_end: bool) -> bool:
    """Whether a piece the offsets give a token is that token's text (characters it completes before it)."""
    token = entry.token
    return not token or "\ufffd" in token or piece.endswith(token) or (past_end and not piece)


def _carry_split_characters(entries: Sequence[Entry], pieces: list[str]) -> list[str]:
    """Move each character a token only starts to the token that completes it.

    vLLM spells a token that ends inside a character with a trailing U+FFFD and counts it as one
    character in its offsets, which would give the whole character to the token that starts it.
    """
    for i in range(len(pieces) - 1):
        token = entries[i].token
        k = min(len(token) - len(token.rstrip("\ufffd")), len(pieces[i]))
        if k and "\ufffd" not in pieces[i][-k:]:  # a U+FFFD the text holds is a whole character
            pieces[i], pieces[i + 1] = pieces[i][:-k], pieces[i][-k:] + pieces[i + 1]
    return pieces


def _align(tokens: Sequence[str], text: str, skipped: bool = False) -> list[str]:
    """Pieces of `text`, one per token, from token texts that may hold U+FFFD for half characters.

    A half-character token gets an empty piece; the next token that matches takes the
    characters in between, so the pieces always spell the text exactly. With `skipped`, a
    token the rest of the text does not hold is one the server left out of it: empty too.
    """
    pieces: list[str] = []
    at = 0
    for token in tokens:
        if not token or "\ufffd" in token:
            pieces.append("")
            continue
        found = text.find(token, at)
        if found < 0 and skipped:
            pieces.append("")
            continue
        if found < 0:
            raise RemoteServerError(
                "the server's tokens do not spell its completion text",
                "use a server whose logprobs report tokens and text offsets",
            )
        pieces.append(text[at : found + len(token)])
        at = found + len(token)
    if pieces:
        pieces[-1] += text[at:]
    return pieces


def tail(entries: Sequence[Entry], n_generated: int, n_chars: int, *, last: int | None = None) -> list[Entry]:
    """The trailing prompt tokens that cover the last `n_chars` characters.

    Offsets may be counted on the detokenized text (special tokens empty), so
    positions are taken relative to the end of the prompt, never its start.
    A token straddling the boundary belongs to the candidate.
    """
    prompt = list(entries[: len(entries) - n_generated])
    if not prompt:
        raise RemoteServerError("the server echoed no prompt tokens", "it must support echo with logprobs")
    if last is not None:
        picked = prompt[-last:]
    else:
        end = entries[len(prompt)].offset if n_generated else prompt[-1].offset + len(prompt[-1].token)
        ends = [e.offset for e in prompt[1:]] + [end]
        start = end - n_chars
        first = next((i for i, stop in enumerate(ends) if stop > start), len(prompt) - 1)
        picked = prompt[first:]
    if any(e.logprob is None for e in picked):
        raise RemoteServerError("the server gave no log-probability for a candidate token", "")
    return picked


def known_logprobs(entries: Sequence[Entry]) -> list[float] | None:
    """Each entry's log-probability; None where one is missing."""
    found = [e.logprob for e in entries if e.logprob is not None]
    return found if len(found) == len(entries) else None


def candidate_logprobs(entries: Sequence[Entry]) -> list[float]:
    """Each entry's log-probability: a candidate token without one is the server's fault."""
    found = known_logprobs(entries)
    if found is None:
        raise RemoteServerError("the server gave no log-probability for a candidate token", "")
    return found


def scores_of(picked: Sequence[Entry]) -> TokenScores:
    """Servers give log-probabilities, not logits: they stand in for both."""
    lps = tuple(candidate_logprobs(picked))
    tops = [e.top for e in picked if e.top is not None]
    return TokenScores(lps, lps, tuple(tops) if len(tops) == len(picked) else None)


def logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def choices_of(data: Any, n: int) -> list[dict[str, Any]]:
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        raise RemoteServerError(
            f"expected {n} completion choice(s), got {data!r:.200}", "is this an OpenAI-compatible completions server?"
        )
    return sorted(choices, key=lambda c: c.get("index", 0))
