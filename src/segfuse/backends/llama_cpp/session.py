"""One request's context in a llama.cpp member's cache (the layout is in ``member.py``'s docstring).

``LlamaCppSession`` syncs its context, samples, lays out its candidates and
reads their scores; its drafts and verifications run through the batch drivers
of ``batch.py``, as one session's part of a batch that may hold several. It works
with the member's parts: the vocabulary, the context it decodes into, the slots
(its own, the prefix cache), and the log-softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...errors import PromptTooLongError
from ...types import DraftTokens, Sampling, TokenScores
from ..base import OnText
from ..cached import CachedSession, DraftState, Verified
from .batch import VerifyPlan, draft_batch, verify_batch
from .context import Context
from .private import PrivateContexts
from .runtime import LogSoftmax
from .slots import MAX_CANDIDATES, Slots
from .vocab import Vocabulary


@dataclass
class InSequence(Verified):
    seq: int = -1  # the cache sequence holding the candidate's cells


class LlamaCppSession(CachedSession):
    """One request's context on a LlamaCppMember: sequence ``base`` of `ctx` and the candidate
    sequences after it, in slot `slot` of `table`. See the module docstring.

    With ``reencode=True`` the session behaves like the paper's reference code
    (every draft and every verification re-encodes the whole context); it
    exists only so the benchmark can measure what the cache saves. Given `private`,
    `ctx` is a context of its own taken from them (a deterministic session, ``private.py``):
    it lives there, from sequence 0, and neither reads nor keeps cached prefixes; `slot` is
    then only counted.
    """

    verified: dict[str, InSequence]  # type: ignore[assignment]  # it verifies only into its own sequences
    streams_text = True

    def __init__(
        self,
        prompt: list[int],
        seed: int | None,
        *,
        vocab: Vocabulary,
        softmax: LogSoftmax,
        ctx: Context,
        table: Slots,
        slot: int = 0,
        private: PrivateContexts | None = None,
        reencode: bool = False,
    ) -> None:
        super().__init__(vocab, prompt, n_ctx=ctx.window, stops=vocab.prompt.stops)
        self.vocab: Vocabulary = vocab
        self.softmax = softmax
        self.table, self.slot = table, slot
        self.private = private
        self.ctx = ctx  # the cache it lives in, and decodes into
        self.base = 0 if private else table.base(slot)  # this session's sequence 0; its candidates follow
        self.reencode = reencode
        self._next_lse: float | None = None
        self.rng = np.random.default_rng(seed)
        self._closed = False
        # the prompt goes to the prefix cache once decoded (not when re-encoding, nor from a context of its own)
        self._prompt_kept = reencode or private is not None

    def set_next(self, row: np.ndarray | None) -> None:
        self.next_logits, self._next_lse = row, None

    def next_row(self) -> tuple[np.ndarray, float]:
        """Logits after the cached context and their log-sum-exp (computed once)."""
        assert self.next_logits is not None
        if self._next_lse is None:
            self._next_lse = self.softmax.lse(self.next_logits)
        return self.next_logits, self._next_lse

    def sync(self) -> None:
        """Decode the context's tokens not yet in the cache, so that the row after it is known."""
        if self.reencode:  # reference behaviour: forget the cache, encode everything again
            self._forget()
            self.n_cached = 0
            self.set_next(None)
            self.pending, self.verified = None, {}  # nothing carries over from drafting to verifying
        start = self.n_cached
        n_batch = self.ctx.n_batch
        while self.n_cached < len(self.tokens):
            chunk = self.tokens[self.n_cached : self.n_cached + n_batch]
            pos = list(range(self.n_cached, self.n_cached + len(chunk)))
            last = self.n_cached + len(chunk) == len(self.tokens)
            rows = self.ctx.decode(chunk, pos, [self.base] * len(chunk), [False] * (len(chunk) - 1) + [last])
            self.stats.decode_calls += 1
            self.n_cached += len(chunk)
            if last:
                self.set_next(rows[0].copy())
        self.count_synced(start)
        if self.next_logits is None:
            raise RuntimeError("context is empty")
        if not self._prompt_kept:
            # Requests that arrive while this one runs may start from its prompt (a shared system prompt).
            self._prompt_kept = True
            self.table.keep_prefix(self.base, self.tokens[: self.prompt_len], self.cache_salt)

    def sample(self, row: np.ndarray, sampling: Sampling) -> int:
        """A token from `row` under `sampling` (greedy: the top one), with this session's generator."""
        if sampling.greedy:
            token = int(row.argmax())
            if sampling.ignore_eos and self.vocab.is_eog(token):
                masked = row.copy()
                masked[self.vocab.eog_ids] = -np.inf
                token = int(masked.argmax())
            return token
        p = self.softmax.probs(row, sampling.temperature)
        if sampling.ignore_eos:
            p[self.vocab.eog_ids] = 0.0
        if sampling.top_p >= 1.0:
            idx = None
        else:
            # The nucleus lies among tokens above a small floor whenever their mass
            # reaches top_p: sort those few instead of the whole vocabulary.
            idx = np.flatnonzero(p >= 1e-5)
            if float(p[idx].sum()) < sampling.top_p:
                idx = np.arange(len(p))
            idx = idx[np.argsort(-p[idx], kind="stable")]
            cum = np.cumsum(p[idx])
            keep = min(int(np.searchsorted(cum, sampling.top_p)) + 1, len(idx))
            idx = idx[:keep]
        weights = p if idx is None else p[idx]
        cum = np.cumsum(weights)
        pick = min(int(np.searchsorted(cum, self.rng.random() * cum[-1], "right")), len(cum) - 1)
        return pick if idx is None else int(idx[pick])

    def draft(self, max_tokens: int, sampling: Sampling, on_text: OnText | None = None) -> DraftTokens:
        self.sync()
        return draft_batch([self], [(max_tokens, sampling, on_text)])[0]

    def hold_draft(self, draft: DraftState) -> None:
        """Keep a finished draft's tokens pending until ``accept`` says what was kept."""
        self.pending = draft

    def _verify(
        self, texts: list[str], encoded: list[list[int]] | None = None, keep_rows: bool = False
    ) -> dict[str, TokenScores]:
        plan = VerifyPlan(self, texts, {}, texts, keep_rows=keep_rows)
        self._lay_out(plan, encoded)
        verify_batch([plan])
        return plan.results

    def _pick(self, row: np.ndarray, sampling: Sampling, drafted: list[int]) -> int:
        allowed = self.allowed_next(drafted)  # as ``batch.Drafting.step`` picks
        return self.sample(row if allowed is None else np.where(allowed, row, -np.inf), sampling)

    def _token_score(self, row: np.ndarray, token: int) -> tuple[float, float]:
        logit = float(row[token])
        return logit - self.softmax.lse(row), logit

    def plan_scores(self, texts: list[str]) -> VerifyPlan:
        """What verifying `texts` needs (for a batch of sessions): known scores, the new candidates laid out."""
        known, pending = self.known_scores(texts)
        plan = VerifyPlan(self, texts, known, pending)
        self._lay_out(plan)
        return plan

    def _lay_out(self, plan: VerifyPlan, encoded: list[list[int]] | None = None) -> None:
        """Each pending candidate in a sequence of its own, after a copy of the context's cells."""
        if len(plan.pending) + len(self.verified) > MAX_CANDIDATES:
            raise ValueError(f"at most {MAX_CANDIDATES} distinct candidates per round")
        n_prefix = len(self.tokens)
        plan.encoded = encoded if encoded is not None else [self.vocab.encode_continuation(t) for t in plan.pending]
        total = sum(len(ids) for ids in plan.encoded)
        if total > self.ctx.n_batch or n_prefix + total > self.n_ctx:
            raise PromptTooLongError(f"{self.vocab.name}: the candidates do not fit the context", "lower --window")
        for i, ids in enumerate(plan.encoded):
            seq = self.base + 1 + len(self.verified) + i
            self.ctx.seq_cp(self.base, seq, 0, n_prefix)
            plan.tokens += ids
            plan.positions += range(n_prefix, n_prefix + len(ids))
            plan.seqs += [seq] * len(ids)

    def text_logprob(self, text: str, max_tokens: int = 256) -> tuple[float, int]:
        """How well this member predicts `text` on its own (prompt-fit weights): see :func:`text_logprob`."""
        return text_logprob(self, text, max_tokens)

    def _end_score(self) -> TokenScores:
        """The candidate "stop here": probability of any end-of-generation token."""
        row, lse = self.next_row()
        eog = row[self.vocab.eog_ids]
        top = float(eog.max())
        logprob = top + math.log(float(np.exp(eog - top).sum())) - lse
        return TokenScores((logprob,), (top,), (float(row.max()) - lse,))

    def finish_verify(self, plan: VerifyPlan, rows: np.ndarray) -> None:
        """Scores of the planned candidates from their decoded rows (row r predicts the token after r)."""
        # The prefix row predicts each candidate's first token; none is known when the candidates start with
        # the context's last tokens, not yet decoded (speculating): that first token is given, not scored.
        prefix_row, prefix_lse = self.next_row() if self.next_logits is not None else (rows[0], None)
        self.stats.verify += len(plan.tokens)
        self.stats.verify_calls += 1
        self.stats.decode_calls += 1
        # Each candidate's first token is predicted by the prefix row.
        at = 0
        for text, ids in zip(plan.pending, plan.encoded):
            logprobs, logits, tops = [], [], []
            for i, token in enumerate(ids):
                row, lse = (prefix_row, prefix_lse) if i == 0 else (rows[at + i - 1], None)
                lse = lse if lse is not None else self.softmax.lse(row)
                logit = float(row[token])
                logits.append(logit)
                logprobs.append(logit - lse)
                tops.append(float(row.max()) - lse)
            scores = TokenScores(tuple(logprobs), tuple(logits), tuple(tops))
            seq = plan.seqs[at]
            last = rows[at + len(ids) - 1].copy()
            kept = [prefix_row, *(rows[at + i].copy() for i in range(len(ids) - 1)), last] if plan.keep_rows else None
            self.verified[text] = InSequence(ids, scores, last, kept, seq)
            plan.results[text] = scores
            at += len(ids)

    def _truncate(self, length: int) -> None:
        self.ctx.seq_rm(self.base, length, -1)

    def _adopt(self, candidate: Verified, n_prefix: int) -> None:
        assert isinstance(candidate, InSequence)
        self.ctx.seq_cp(candidate.seq, self.base, n_prefix, -1)

    def _drop_candidates(self) -> None:
        for candidate in self.verified.values():
            self.ctx.seq_rm(candidate.seq, -1, -1)

    def _forget(self) -> None:
        """Drop every cell this session holds."""
        if self.private is not None:
            self.ctx.clear()
        else:
            self.table.clear(self.slot)

    def close(self) -> None:
        """Free the slot; the context's cached cells stay in the member's prefix cache (a context of its
        own is emptied and kept for the next deterministic session)."""
        if self._closed:
            return
        self._closed = True
        if self.private is None:
            self.table.release(self.slot, None if self.reencode else self.tokens[: self.n_cached], self.cache_salt)
            return
        try:
            self.private.give_back(self.ctx)
        finally:
            self.table.release(self.slot)


def text_logprob(session: LlamaCppSession, text: str, max_tokens: int = 256) -> tuple[float, int]:
    """How well this member predicts `text` on its own (prompt-fit weights).

    Returns the summed natural-log probability of the first `max_tokens`
    tokens of `text` after a newline (and BOS where the model uses one),
    and the number of bytes they spell. Runs in a spare sequence of the
    cache, before any candidate is verified; the session's context is
    untouched.
    """
    vocab = session.vocab
    if session.verified:
        raise RuntimeError("text_logprob must run before candidates are verified")
    anchor = vocab.tokenize("\n", add_special=True, parse_special=False)
    ids = vocab.encode_continuation(text)[:max_tokens]
    if not ids:
        return 0.0, 0
    seq, tokens = session.base + 1, anchor + ids
    total, at, chunk = 0.0, 0, 64
    try:
        while at < len(tokens) - 1:
            part = tokens[at : at + chunk]
            rows = session.ctx.decode(part, list(range(at, at + len(part))), [seq] * len(part), [True] * len(part))
            session.stats.decode_calls += 1
            for r, row in enumerate(rows):
                target = at + r + 1  # row r predicts the token after part[r]
                if len(anchor) <= target < len(tokens):
                    total += float(row[tokens[target]]) - session.softmax.lse(row)
            at += len(part)
    finally:
        session.ctx.seq_rm(seq, -1, -1)
    return total, len(b"".join(vocab.piece(t) for t in ids))
