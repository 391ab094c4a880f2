"""The small protocol every backend implements. The engine only sees this.

A *member* is a loaded model. For each request it opens a *session*: the
member's own context (its templated prompt plus the accepted answer so far)
and whatever cache makes extending it cheap. A session does three things:

- ``draft``: continue the context by up to N tokens; the drafted tokens stay
  pending until ``accept`` says what was kept;
- ``score``: per-token log-probabilities of candidate texts on the context;
- ``accept``: append the winning text to the context (dropping draft tails).

Optional, used when present (a backend without them still works):
- ``Member.n_params``: parameter count; the confidence gate's default leader
  is the largest member when every member states its size;
- ``MemberSession.text_logprob(text) -> (summed log-prob, bytes)``: how well
  the member predicts a text on its own (prompt-fit voting weights); llama.cpp
  members have it, and an ensemble with a member without it keeps its weights.
- ``Member.draft_many(sessions, [(max_tokens, sampling), ...])`` and
  ``Member.score_many(sessions, [(texts,), ...])``: the same calls for several
  sessions of this member at once (one result or exception per session); the
  scheduler uses them to batch requests together (llama.cpp members batch
  every session's token into one decode). Without them, sessions are called
  one by one (local) or concurrently (``parallel_safe = True``, remote).
- ``Member.slots``: how many sessions the member holds at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..types import DraftTokens, Message, Sampling, TokenScores


@runtime_checkable
class MemberSession(Protocol):
    def draft(self, max_tokens: int, sampling: Sampling) -> DraftTokens:
        """Sample up to `max_tokens` tokens after the context."""
        ...

    def score(self, texts: Sequence[str]) -> list[TokenScores]:
        """Score each text as a continuation of the context, in order.

        An empty text scores the member's end-of-generation token (the
        candidate "stop here").
        """
        ...

    def accept(self, text: str) -> None:
        """Append `text` to the context."""
        ...

    @property
    def stops(self) -> tuple[str, ...]:
        """Stop strings of this member's prompt format (e.g. a base model's next "Question:")."""
        ...

    @property
    def room(self) -> int:
        """How many more tokens fit in this session's context window."""
        ...

    def counters(self) -> dict[str, int]:
        """Work done so far (tokens decoded per kind), for tests and benchmarks."""
        ...

    def close(self) -> None:
        """Release the session (its cache, the member's lock)."""
        ...


@runtime_checkable
class Member(Protocol):
    name: str

    def start(
        self, messages: Sequence[Message], *, seed: int | None, reserve: int
    ) -> MemberSession:
        """Open a session on the templated `messages`.

        Raises PromptTooLongError if the prompt plus `reserve` tokens does not
        fit the member's context window.
        """
        ...

    def close(self) -> None:
        """Free the model."""
        ...
