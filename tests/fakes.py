"""Scripted members for unit tests of pure engine, scheduler and worker logic.

They follow the member protocol (``backends.base``) with canned drafts and
preferences instead of a model, so a test can say exactly what each member
drafts and how it scores every text. The real-model tests prove the real thing.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from segfuse.backends.base import Capabilities, Member, MemberSession
from segfuse.types import DraftTokens, TokenScores

NOTHING_MORE = Capabilities()  # the required calls only (frozen: one shared default is safe)


class ScriptedSession(MemberSession):
    """Drafts what it is told, round by round; scores a text by a fixed probability per token."""

    def __init__(self, drafts, prefs, stops=(), room=10_000):
        self.drafts = list(drafts)  # per round: (pieces, finished)
        self.prefs = prefs  # text -> probability this member gives each token of it
        self.accepted: list[str] = []
        self._stops = tuple(stops)
        self._room = room
        self.closed = False
        self.drafted = 0
        self.scored: list[list[str]] = []

    @property
    def stops(self):
        return self._stops

    @property
    def room(self):
        return self._room

    def draft(self, max_tokens, sampling):
        self.drafted += 1
        pieces, finished = self.drafts.pop(0) if self.drafts else ([b""], True)
        pieces = pieces[:max_tokens]
        lps = tuple(math.log(self.prefs.get(b"".join(pieces).decode(), 0.1)) for _ in pieces)
        return DraftTokens(tuple(pieces), lps, lps, finished)

    def score(self, texts):
        """One token per text at the member's preference; its top choice is its favourite text's probability."""
        self.scored.append(list(texts))
        favourite = max(self.prefs.values(), default=0.1)
        return [
            TokenScores(
                (math.log(self.prefs.get(t, 0.1)),), (0.0,), (math.log(max(favourite, self.prefs.get(t, 0.1))),)
            )
            for t in texts
        ]

    def accept(self, text):
        self.accepted.append(text)

    def counters(self):
        return {"drafts": self.drafted, "scores": len(self.scored)}

    def close(self):
        self.closed = True


class FittedSession(ScriptedSession):
    """A scripted session that also reports how well it predicts the prompt."""

    def __init__(self, drafts, prefs, bpb):
        super().__init__(drafts, prefs)
        self.bpb = bpb

    def text_logprob(self, text):
        n = len(text.encode())
        return -self.bpb * math.log(2.0) * n, n


@dataclass(eq=False)  # members are told apart by identity, as real ones are
class ScriptedMember(Member):
    """Hands out the given session(s): one for every request, or a new one per request from a factory."""

    name: str
    session: MemberSession | None = None
    _: KW_ONLY
    factory: Callable[..., MemberSession] | None = None
    capabilities: Capabilities = NOTHING_MORE
    slots: int | None = None
    n_params: int | None = None
    started: int = field(default=0, init=False)

    def new_session(self, messages, options):
        self.started += 1
        return self.factory(messages) if self.factory else self.session


class BatchingMember(ScriptedMember):
    """Declares batching and records every batched call: (method, number of sessions)."""

    def __init__(self, name, **kwargs):
        super().__init__(name, capabilities=Capabilities(batched=True), **kwargs)
        self.batches: list[tuple[str, int]] = []

    def draft_many(self, sessions, requests):
        self.batches.append(("draft", len(sessions)))
        return super().draft_many(sessions, requests)

    def score_many(self, sessions, requests):
        self.batches.append(("score", len(sessions)))
        return super().score_many(sessions, requests)


class BlockingSession(ScriptedSession):
    """A session whose drafts wait until the test releases them (a slow member)."""

    def __init__(self, drafts, prefs, gate: threading.Event):
        super().__init__(drafts, prefs)
        self.gate = gate

    def draft(self, max_tokens, sampling):
        self.gate.wait(10)
        return super().draft(max_tokens, sampling)


def fitted(name, session: FittedSession) -> ScriptedMember:
    """A member whose sessions report prompt fit (it declares the capability)."""
    return ScriptedMember(name, session, capabilities=Capabilities(prompt_fit=True))
