"""The small protocol every backend implements. The engine only sees this.

A *member* is a loaded model. For each request it opens a *session*: the
member's own context (its templated prompt plus the accepted answer so far)
and whatever cache makes extending it cheap. A session does three things:

- ``draft``: continue the context by up to N tokens; the drafted tokens stay
  pending until ``accept`` says what was kept;
- ``score``: per-token log-probabilities of candidate texts on the context;
- ``accept``: append the winning text to the context (dropping draft tails).

What a member can do beyond that is *declared*, never probed:

- ``Member.capabilities`` (:class:`Capabilities`): whether its calls may run in
  threads beside others' (remote servers, a llama.cpp member wholly on a GPU:
  ``engine/calls.py``), whether ``draft_many`` / ``score_many`` batch several sessions
  into one decode (llama.cpp), whether its sessions offer ``text_logprob``
  (prompt-fit voting weights), whether they draft under a constraint
  (``constrain``: structured output);
- ``Member.slots``: how many sessions it holds at once (None: any number);
- ``Member.n_params``: its parameter count, where known (the confidence gate's
  default leader is the largest member when every member states its size);
- ``Member.nbytes``: the bytes it takes where it runs, where known: its weights, and
  for llama.cpp the KV cache and compute buffers it allocated too (the server's
  memory budget counts them);
- ``Member.prompt_tokens``: the templated prompt's tokens, where the member can
  tell (the server reports them as usage);
- ``Member.occupancy``: the session slots free and the KV-cache cells held now
  (by sessions, by the prefix cache kept between requests, by neither: a leak),
  where the member can tell (the server shows them, so that a leak is seen).

Subclass :class:`Member` and :class:`MemberSession`; the defaults say "cannot",
and the batched calls default to one session after another.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..segments import complete_utf8_prefix
from ..types import DraftTokens, Message, PromptToken, Sampling, Speculation, TokenScores
from .prefix_cache import PrefixStats

if TYPE_CHECKING:
    from ..constraints import Constraint

log = logging.getLogger("segfuse.backends")

T = TypeVar("T")

# A draft's hook: called with the draft's text so far (whole characters) after each sampled token.
OnText = Callable[[str], None]


@dataclass(frozen=True)
class Capabilities:
    """What a member can do beyond the required calls."""

    parallel_safe: bool = False  # its calls may run beside other members' (remote servers; llama.cpp on a GPU)
    batched: bool = False  # draft_many / score_many serve several sessions in one decode
    prompt_fit: bool = False  # its sessions offer text_logprob
    constrained: bool = False  # its sessions draft under a constraint (structured output): ``constrain``
    echo: bool = False  # it reports a whole text's token log-probabilities: ``Member.echo`` (and tokenizes)
    speculates: bool = False  # its sessions verify drafts for themselves: ``MemberSession.speculate``


@dataclass(frozen=True)
class Occupancy:
    """What a member holds right now; None where it cannot tell (a remote server keeps its cache)."""

    slots: int | None = None  # sessions it can hold at once
    free_slots: int | None = None  # of those, not taken by an open session
    cache_cells: int | None = None  # KV-cache positions open sessions hold, summed over their sequences
    stray_cells: int | None = None  # positions held by no session and no prefix-cache entry (a leak)
    prefix: PrefixStats | None = None  # the prefix cache kept between requests, where the member has one


class TextSoFar:
    """Reports a draft's text to its ``on_text`` hook as tokens come: only when it grew, and only
    whole characters (a character split across tokens waits for its last byte)."""

    def __init__(self, on_text: OnText | None) -> None:
        self.on_text = on_text
        self.data = b""
        self.sent = 0  # bytes reported so far

    def add(self, piece: bytes) -> None:
        if self.on_text is None:
            return
        self.data += piece
        n = complete_utf8_prefix(self.data)
        if n > self.sent:
            self.sent = n
            try:
                self.on_text(self.data[:n].decode("utf-8", errors="replace"))
            except Exception:  # a listener's fault must not fail the draft (nor a batch's others)
                log.exception("a draft's on_text hook failed; it is not called again")
                self.on_text = None


class MemberSession(ABC):
    """One request's context on a member."""

    streams_text: bool = False  # its draft calls ``on_text`` as it samples (the engine passes one only then)

    @abstractmethod
    def draft(self, max_tokens: int, sampling: Sampling, on_text: OnText | None = None) -> DraftTokens:
        """Sample up to `max_tokens` tokens after the context.

        `on_text` (sessions that declare ``streams_text``): called after each sampled token with the
        draft's text so far, whole characters only; others never call it."""

    def constrain(self, constraint: Constraint) -> None:
        """Draft only tokens that keep the answer (as accepted so far, whoever wrote it) a valid prefix
        under `constraint`; members that declare ``Capabilities.constrained`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot draft under a constraint")

    @abstractmethod
    def score(self, texts: Sequence[str]) -> list[TokenScores]:
        """Score each text as a continuation of the context, in order.

        An empty text scores the member's end-of-generation token (the
        candidate "stop here").
        """

    @abstractmethod
    def accept(self, text: str) -> None:
        """Append `text` to the context."""

    @property
    @abstractmethod
    def stops(self) -> tuple[str, ...]:
        """Stop strings of this member's prompt format (e.g. a base model's next "Question:")."""

    @property
    @abstractmethod
    def room(self) -> int:
        """How many more tokens fit in this session's context window."""

    @abstractmethod
    def counters(self) -> dict[str, int]:
        """Work done so far (tokens decoded per kind), for tests and benchmarks."""

    @abstractmethod
    def close(self) -> None:
        """Release the session (its cache, the member's slot)."""

    def speculate(self, drafts: Sequence[str], max_tokens: int, sampling: Sampling) -> Speculation:
        """Continue the context by the tokens this member would write on its own, reading `drafts`
        (texts that may continue it) in one pass: the longest prefix of any draft that its own
        sampling under `sampling` reproduces, then one token of its own; at most `max_tokens` in all.
        The kept tokens stay pending until ``accept`` (as a draft's do). Members that declare
        ``Capabilities.speculates`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot verify drafts for itself")

    def text_logprob(self, text: str) -> tuple[float, int]:
        """(summed natural-log probability, bytes) of `text` on its own; see ``Capabilities.prompt_fit``."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a text on its own")


@dataclass(frozen=True)
class SessionOptions:
    """How a session opens (see :meth:`Member.start`)."""

    seed: int | None
    reserve: int  # tokens the answer may take beyond the prompt
    cache_salt: str | None = None
    deterministic: bool = False


class Member(ABC):
    """A loaded model that opens sessions."""

    name: str
    capabilities: Capabilities = Capabilities()
    slots: int | None = None  # sessions held at once; None: any number
    n_params: int | None = None  # parameter count, where known
    nbytes: int | None = None  # bytes it takes where it runs (weights, allocated caches), where known (a memory budget)
    placement: str | None = None  # where it runs, in words ("CPU", "GPU: 31/31 layers", ...), where known

    def start(
        self,
        messages: Sequence[Message],
        *,
        seed: int | None,
        reserve: int,
        cache_salt: str | None = None,
        deterministic: bool = False,
    ) -> MemberSession:
        """Open a session on the templated `messages`.

        Raises PromptTooLongError if the prompt plus `reserve` tokens does not
        fit the member's context window. `cache_salt`: the session starts only
        from prefixes cached under the same salt, and keeps its own under it
        (members without a prefix cache ignore it). `deterministic`: the
        session's numbers must not depend on other sessions, earlier or at
        the same time (no cached prefix, no shared decode); a member that
        cannot promise it (a remote server) ignores it.
        """
        return self.new_session(messages, SessionOptions(seed, reserve, cache_salt, deterministic))

    @abstractmethod
    def new_session(self, messages: Sequence[Message], options: SessionOptions) -> MemberSession:
        """What :meth:`start` does, with its options in one object: a backend implements this."""

    def close(self) -> None:  # noqa: B027  # a default, not abstract: a member with nothing to free keeps it
        """Free the model."""

    def save_prefix_cache(self) -> int:
        """Write the prefixes it caches to its prefix-cache directory, where it keeps one (llama.cpp members
        given ``prefix_cache_dir``); how many files it wrote. Call it from the thread that runs its calls."""
        return 0

    def prompt_tokens(self, messages: Sequence[Message]) -> list[int] | None:
        """The templated prompt's tokens; None where the member cannot tell."""
        return None

    def tokenize_text(self, text: str) -> list[int] | None:
        """`text`'s tokens as they are (no special tokens added or parsed); None where the member cannot tell."""
        return None

    def lead_tokens(self) -> list[int]:
        """The tokens the model reads before a text (its BOS, where it uses one): not echoed, and what
        ``/tokenize`` adds when asked for special tokens."""
        return []

    def detokenize(self, tokens: Sequence[int]) -> str | None:
        """The text `tokens` spell; None where the member cannot tell."""
        return None

    def echo(self, prompt: str | Sequence[int], top_k: int = 0) -> list[PromptToken]:
        """Every token of `prompt` (a text, tokenized with :meth:`tokenize_text`, or this member's token
        ids) with its log-probability given those before it and its `top_k` likeliest alternatives,
        from the text's start (after the BOS the model reads first, which is not echoed). Members that
        declare ``Capabilities.echo`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot report a prompt's log-probabilities")

    def occupancy(self) -> Occupancy:
        """Slots free and cache cells held. Call it only from the thread that runs this member's
        calls: a cache must not be read while it decodes."""
        return Occupancy(slots=self.slots)

    def draft_many(
        self,
        sessions: Sequence[MemberSession],
        requests: Sequence[tuple[int, Sampling] | tuple[int, Sampling, OnText | None]],
    ) -> list[DraftTokens | Exception]:
        """``draft`` for several sessions: one result or exception per session, in order (each request is
        ``draft``'s positional arguments, the ``on_text`` hook included where given)."""
        return [_outcome(s.draft, *request) for s, request in zip(sessions, requests)]

    def score_many(
        self, sessions: Sequence[MemberSession], requests: Sequence[tuple[Sequence[str]]]
    ) -> list[list[TokenScores] | Exception]:
        """``score`` for several sessions: one result or exception per session, in order."""
        return [_outcome(s.score, *request) for s, request in zip(sessions, requests)]


def _outcome(fn: Callable[..., T], *args: Any) -> T | Exception:
    try:
        return fn(*args)
    except Exception as exc:  # one session's failure is that session's result
        return exc
