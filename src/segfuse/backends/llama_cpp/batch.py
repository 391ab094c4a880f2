"""Several llama.cpp sessions' drafts and verifications in shared decodes (``draft_many``, ``score_many``).

``Drafting`` and ``VerifyPlan`` are one session's part of a batch; the drivers below run
the parts of every session at once: drafting advances each drafting session by one token
per ``llama_decode``; verifying decodes every session's new candidates in one batch,
chunked at ``n_batch``. One session alone (``LlamaCppSession.draft``, ``score``) goes
through the same drivers with a batch of one, so it decodes exactly as before. Sessions
share a decode only when they share a context: a deterministic session, in a context of
its own (``private.py``), is decoded apart. The drivers see a session only as
:class:`BatchSession`: its context, vocabulary and log-softmax, and its part of a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ...types import DraftTokens, Sampling, TokenScores
from ..base import OnText
from ..cached import Counters, DraftState, top_alternatives
from ..drafting import DraftProgress
from .context import Context
from .runtime import LogSoftmax
from .vocab import Vocabulary


class BatchSession(Protocol):
    """What the drivers use of a session (``LlamaCppSession``)."""

    ctx: Context  # the context it decodes into
    base: int  # its context's sequence
    tokens: list[int]
    stats: Counters
    vocab: Vocabulary
    softmax: LogSoftmax

    def sync(self) -> None: ...
    def next_row(self) -> tuple[np.ndarray, float]: ...
    def allowed_next(self, drafted: Sequence[int]) -> np.ndarray | None: ...
    def sample(self, row: np.ndarray, sampling: Sampling) -> int: ...
    def hold_draft(self, draft: DraftState) -> None: ...
    def plan_scores(self, texts: list[str]) -> VerifyPlan: ...
    def finish_verify(self, plan: VerifyPlan, rows: np.ndarray) -> None: ...


@dataclass
class VerifyPlan:
    """One session's part of a verification batch."""

    session: BatchSession
    texts: list[str]
    results: dict[str, TokenScores]  # known already (verified this round, or the end token)
    pending: list[str] = field(default_factory=list)
    encoded: list[list[int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    keep_rows: bool = False  # keep every candidate's rows (a session speculating walks them)

    def answer(self) -> list[TokenScores]:
        return [self.results[t] for t in self.texts]


class Drafting(DraftProgress[np.ndarray]):
    """One session's draft in progress: sample from the current row, feed the token, repeat."""

    def __init__(
        self,
        session: BatchSession,
        n: int,
        sampling: Sampling,
        row: np.ndarray,
        lse: float,
        on_text: OnText | None = None,
    ) -> None:
        super().__init__(n, sampling, on_text, start=len(session.tokens))
        self.session = session
        self.row, self.lse = row, lse

    def step(self) -> bool:
        """Sample the next token; True when it must be decoded for the draft to go on."""
        if self.done:
            return False
        allowed = self.session.allowed_next(self.ids)  # under a constraint; scores stay the model's own
        token = self.session.sample(
            self.row if allowed is None else np.where(allowed, self.row, -np.inf), self.sampling
        )
        vocab = self.session.vocab
        going_on = self.took(self.row, token, float(self.row[token]), self.lse, vocab.is_eog(token))
        self.text.add(vocab.piece(token))
        return going_on

    def fed(self, row: np.ndarray, lse: float) -> None:
        self.row, self.lse = row, lse
        self.count_fed(self.session.stats)

    def finish(self) -> DraftTokens:
        piece = self.session.vocab.piece
        pieces = [piece(t) for t in self.ids]
        self.session.hold_draft(DraftState(self.ids, pieces, self.rows))
        k = self.sampling.top_logprobs
        return self.tokens(pieces, top_alternatives(self.rows, k, piece) if k else ())


def by_context(items: Sequence[Any], ctx_of: Callable[[Any], Any]) -> list[list[Any]]:
    """`items` grouped by the context they decode into (in order of first appearance)."""
    groups: dict[int, list[Any]] = {}
    for item in items:
        groups.setdefault(id(ctx_of(item)), []).append(item)
    return list(groups.values())


def _prepare(sessions: Sequence[Any], prepare: Callable[[int, Any], None]) -> tuple[list[int], list[Any]]:
    """Run each session's own preparation; one that raises gets its exception, the others go on."""
    ready: list[int] = []
    out: list[Any] = [None] * len(sessions)
    for i, session in enumerate(sessions):
        try:
            prepare(i, session)
        except Exception as exc:
            out[i] = exc
            continue
        ready.append(i)
    return ready, out


def draft_many(sessions: Sequence[BatchSession], requests: Sequence[tuple[Any, ...]]) -> list[DraftTokens | Exception]:
    """``draft`` for several sessions, one ``llama_decode`` per token step for all of them."""
    ready, out = _prepare(sessions, lambda i, s: s.sync())
    try:
        drafts: Sequence[DraftTokens | Exception] = draft_batch(
            [sessions[i] for i in ready], [requests[i] for i in ready]
        )
    except Exception as exc:  # the decode failed for all of them
        drafts = [exc] * len(ready)
    for i, draft in zip(ready, drafts):
        out[i] = draft
    return out


def draft_batch(sessions: Sequence[BatchSession], requests: Sequence[tuple[Any, ...]]) -> list[DraftTokens]:
    """Draft for synced sessions; a request is draft's positional arguments: (n, sampling) or
    (n, sampling, on_text)."""
    drafting = [Drafting(s, n, sampling, *s.next_row(), *hook) for s, (n, sampling, *hook) in zip(sessions, requests)]
    while True:
        feeding = [d for d in drafting if d.step()]
        if not feeding:
            break
        for group in by_context(feeding, lambda d: d.session.ctx):
            rows = group[0].session.ctx.decode(
                [d.ids[-1] for d in group], [d.pos for d in group], [d.session.base for d in group], [True] * len(group)
            )
            for d, row in zip(group, rows):
                d.fed(row.copy(), d.session.softmax.lse(row))
    return [d.finish() for d in drafting]


def score_many(
    sessions: Sequence[BatchSession], texts: Sequence[tuple[Sequence[str]]]
) -> list[list[TokenScores] | Exception]:
    """``score`` for several sessions: every session's new candidates in one batch (chunked at n_batch)."""
    plans: dict[int, VerifyPlan] = {}

    def plan(i: int, session: BatchSession) -> None:
        plans[i] = session.plan_scores(list(texts[i][0]))

    ready, out = _prepare(sessions, plan)
    try:
        for group in by_context([plans[i] for i in ready], lambda p: p.session.ctx):
            chunk: list[VerifyPlan] = []
            n_batch = group[0].session.ctx.n_batch
            for p in group:
                if sum(len(q.tokens) for q in chunk) + len(p.tokens) > n_batch:
                    verify_batch(chunk)
                    chunk = []
                chunk.append(p)
            verify_batch(chunk)
        for i in ready:
            out[i] = plans[i].answer()
    except Exception as exc:
        for i in ready:
            out[i] = exc
    return out


def verify_batch(plans: Sequence[VerifyPlan]) -> None:
    """Decode the candidates of several sessions of one context in one batch and hand each its rows."""
    plans = [p for p in plans if p.tokens]
    if not plans:
        return
    tokens = [t for p in plans for t in p.tokens]
    rows = plans[0].session.ctx.decode(
        tokens, [x for p in plans for x in p.positions], [x for p in plans for x in p.seqs], [True] * len(tokens)
    )
    at = 0
    for p in plans:
        p.session.finish_verify(p, rows[at : at + len(p.tokens)])
        at += len(p.tokens)
