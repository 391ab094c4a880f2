"""What the local backends (llama.cpp, transformers) share: members with a tokenizer and a
context window, and sessions that keep their KV cache across rounds
(docs/design.md#prefix-caching).

A :class:`CachedSession` holds the context's tokens, how many of them are in the
cache, the pending draft and the candidates verified this round. Its template:

- ``score``: known scores first (candidates verified earlier this round, the
  end-of-generation probability for the empty text "stop here"), each distinct
  new text decoded once on the cached prefix;
- ``accept``: the winner's cells are kept wherever they already are: the
  member's own draft (cut back to the kept tokens), or a verified candidate's
  cells made part of the context; any other text is encoded and decoded at the
  next sync.

A backend supplies only its own cache operations and decode: ``draft``,
``sync`` (decode accepted tokens not yet cached), ``_end_score``, ``_verify``,
``_truncate`` (drop cells from a position on), ``_adopt`` (keep a verified
candidate's cells) and ``_drop_candidates``. A session works with its member's parts
(the vocabulary, a cache), never with the member.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..constraints import Constraint, TokenMatcher
from ..errors import PromptTooLongError
from ..models import PromptFormat
from ..prompting import prefill_of, raw_prompt
from ..segments import tokens_spelling
from ..types import Alternatives, DraftTokens, Message, Sampling, Speculation, TokenScores
from .base import Member, MemberSession, SessionOptions
from .speculation import distinct_drafts, walk
from .vocabulary import LocalVocabulary


def check_prompt_fits(name: str, n_prompt: int, reserve: int, n_ctx: int, *, approximate: bool = False) -> None:
    """Raise PromptTooLongError unless the prompt plus `reserve` drafting tokens fit the window."""
    if n_prompt + reserve > n_ctx:
        about = "about " if approximate else ""
        raise PromptTooLongError(
            f"the prompt is {about}{n_prompt} tokens for {name}, whose context holds {n_ctx} "
            f"(with {reserve} tokens reserved for drafting)",
            "shorten the prompt or load the member with a larger context window (n_ctx)",
        )


@dataclass
class Counters:
    """Tokens decoded per purpose; tests use these to prove what was (not) re-encoded."""

    prompt: int = 0  # prompt tokens, decoded once per session
    reused: int = 0  # prompt tokens found in the prefix cache instead (not decoded)
    catch_up: int = 0  # accepted tokens not already in the cache
    draft: int = 0
    verify: int = 0
    verify_calls: int = 0
    decode_calls: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class DraftState:
    """The member's pending draft: its tokens, their pieces, and the rows that sampled them."""

    ids: list[int]
    pieces: list[bytes]
    rows: list[Any]  # rows[j]: the logits row that sampled ids[j]

    @property
    def n_decoded(self) -> int:
        return len(self.ids) - 1  # the last sampled token is never fed back

    def kept_tokens(self, text: str) -> int | None:
        return tokens_spelling(self.pieces, text)


@dataclass
class Verified:
    """A candidate decoded this round: its tokens, scores, and the row after its last token; `rows`, where
    kept (speculating): the row before each token, then the row after the last."""

    ids: list[int]
    scores: TokenScores
    last_row: Any
    rows: Any = None


class LocalMember(Member):
    """A member whose tokenizer and weights are here; it opens :class:`CachedSession` s."""

    n_ctx: int  # one session's context window, in tokens
    prompt: PromptFormat
    vocab: LocalVocabulary

    def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
        return self.vocab.prompt_tokens(messages)

    def tokenize_text(self, text: str) -> list[int]:
        return self.vocab.tokenize_plain(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.vocab.detokenize(tokens)

    def lead_tokens(self) -> list[int]:
        return self.vocab.lead_tokens()

    @abstractmethod
    def open_session(
        self, prompt: list[int], seed: int | None, cache_salt: str | None = None, deterministic: bool = False
    ) -> CachedSession:
        """A session on a prompt known to fit; it reuses and keeps cached prefixes under `cache_salt` only
        (`deterministic`: see :meth:`Member.start`)."""

    def new_session(self, messages: Sequence[Message], options: SessionOptions) -> CachedSession:
        prompt = self.prompt_tokens(messages)
        check_prompt_fits(self.name, len(prompt), options.reserve, self.n_ctx)
        session = self.open_session(prompt, options.seed, options.cache_salt, options.deterministic)
        session.raw = raw_prompt(messages) is not None
        session.prefill = prefill_of(messages)
        return session


class CachedSession(MemberSession):
    """One request's context on a LocalMember; see the module docstring.

    `vocab`: the member's tokens; `n_ctx`: the context window; `stops`: the prompt format's stop strings."""

    def __init__(self, vocab: LocalVocabulary, prompt: list[int], *, n_ctx: int, stops: tuple[str, ...]) -> None:
        self.vocab = vocab
        self.n_ctx = n_ctx
        self.format_stops = stops
        self.cache_salt: str | None = None  # prefixes it reuses and keeps are under this salt only
        self.prompt_len = len(prompt)
        self.tokens: list[int] = list(prompt)
        self.n_cached = 0  # tokens[:n_cached] are in the cache
        self.next_logits: Any = None  # logits after tokens, once cached
        self.stats = Counters()
        self.pending: DraftState | None = None  # this round's own draft, until accept says what was kept
        self.verified: dict[str, Verified] = {}  # this round's candidates decoded so far
        self._matcher: TokenMatcher | None = None  # under a constraint: what may be drafted next

    raw = False  # a text completion: the prompt format's stop strings do not apply
    prefill = ""  # the final assistant message the answer continues: a constraint reads it first

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.raw else self.format_stops

    @property
    def room(self) -> int:
        return self.n_ctx - len(self.tokens)

    def constrain(self, constraint: Constraint) -> None:
        self._matcher = self.vocab.matcher(constraint, self.prefill)

    def allowed_next(self, drafted: Sequence[int]) -> np.ndarray | None:
        """Under a constraint, the tokens that may follow the answer and the tokens `drafted` so far
        this round (a boolean mask over the vocabulary); None without one."""
        if self._matcher is None:
            return None
        self._matcher.follow([*self.answer_tokens(), *drafted])
        mask = self._matcher.allowed()
        if not mask.any():  # the answer is complete (or the grammar is stuck): only the end may come
            mask[np.asarray(self.vocab.eog_ids, dtype=np.int64)] = True
        return mask

    def counters(self) -> dict[str, int]:
        return self.stats.as_dict()

    def answer_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    # --- the template -------------------------------------------------------------
    def score(self, texts: Sequence[str]) -> list[TokenScores]:
        known, pending = self.known_scores(texts)
        if pending:
            known.update(self._verify(pending))
        return [known[t] for t in texts]

    def known_scores(self, texts: Sequence[str]) -> tuple[dict[str, TokenScores], list[str]]:
        """Scores known without decoding, and the distinct texts still to verify (after a sync)."""
        self.sync()
        known = {t: v.scores for t, v in self.verified.items()}
        if "" in texts:
            known[""] = self._end_score()
        return known, [t for t in dict.fromkeys(texts) if t not in known]

    def speculate(self, drafts: Sequence[str], max_tokens: int, sampling: Sampling) -> Speculation:
        """Every distinct draft decoded on the cached prefix in one pass, then walked as this member writes
        (``speculation.py``); the kept tokens' cells are the walked draft's, and they stay pending until
        ``accept`` as a draft's do. The context's last accepted tokens, where not decoded yet (the token
        the last round ended with), lead every draft in that pass instead of a decode of their own."""
        limit = max(1, min(max_tokens, self.room - 1))
        encoded = [self.vocab.encode_continuation(t) if t else [] for t in drafts]
        distinct, where = distinct_drafts(encoded, limit - 1)
        tail = self.tokens[self.n_cached :] if distinct and self.n_cached and self.pending is None else []
        if not tail:
            self.sync()
        candidates = self._lay_drafts([tail + ids for ids in distinct], len(tail))

        def row_at(d: int, p: int) -> Any:
            return candidates[d].rows[len(tail) + p] if candidates else self.next_logits

        walked = walk(distinct, row_at, lambda row, kept: self._pick(row, sampling, kept), self.vocab.is_eog, limit)
        if candidates and (tail or len(walked.kept) > 1):
            self._truncate(self.n_cached)
            self._adopt(candidates[walked.source], self.n_cached)  # the tail's cells and the kept tokens'
            self.n_cached = len(self.tokens)
        pieces = [self._piece(t) for t in walked.kept]
        self.pending = DraftState(walked.kept, pieces, walked.rows)
        accepted = tuple(walked.accepted[i] if i >= 0 else 0 for i in where)
        proposed = tuple(len(distinct[i]) if i >= 0 else 0 for i in where)
        return Speculation(self._kept_tokens(walked.kept, walked.rows, sampling), accepted, proposed)

    def _lay_drafts(self, drafts: list[list[int]], n_tail: int) -> list[Verified]:
        """Decode `drafts` after the cached prefix in one pass, their rows kept; each starts with the context's
        `n_tail` tokens not yet cached."""
        if not drafts:
            return []
        keys = [f"\x00speculate:{i}" for i in range(len(drafts))]  # never a real candidate's text
        tail = self.tokens[len(self.tokens) - n_tail :] if n_tail else []
        if n_tail:  # lay the drafts out from the last cached token: the tail is part of each
            del self.tokens[len(self.tokens) - n_tail :]
        try:
            self._verify(keys, drafts, keep_rows=True)
        finally:
            self.tokens += tail
        return [self.verified[k] for k in keys]

    def _kept_tokens(self, kept: list[int], rows: list[Any], sampling: Sampling) -> DraftTokens:
        scored = [self._token_score(row, t) for row, t in zip(rows, kept)]
        k = sampling.top_logprobs
        tops = top_alternatives([self._as_numpy(r) for r in rows], k, self._piece) if k else ()
        logprobs = tuple(lp for lp, _ in scored)
        logits = tuple(logit for _, logit in scored)
        return DraftTokens(tuple(self._piece(t) for t in kept), logprobs, logits, self.vocab.is_eog(kept[-1]), tops)

    def _piece(self, token: int) -> bytes:
        return b"" if self.vocab.is_eog(token) else self.vocab.piece(token)

    def accept(self, text: str) -> None:
        n_prefix = len(self.tokens)
        draft = self.pending
        kept = draft.kept_tokens(text) if (draft and text) else None
        if draft is not None and kept is not None:
            # Our own draft won: its tokens are already cached.
            decoded = min(kept, draft.n_decoded)
            self._truncate(n_prefix + decoded)
            self.tokens += draft.ids[:kept]
            self.n_cached = n_prefix + decoded
            self.set_next(draft.rows[kept] if decoded == kept else None)
        elif text and text in self.verified:
            # Another member's candidate won: its cells were computed while verifying.
            candidate = self.verified[text]
            self._truncate(n_prefix)
            self._adopt(candidate, n_prefix)
            self.tokens += candidate.ids
            self.n_cached = len(self.tokens)
            self.set_next(candidate.last_row)
        else:
            self._truncate(n_prefix)
            if text:
                self.tokens += self.vocab.encode_continuation(text)
                self.n_cached = min(self.n_cached, n_prefix)  # the new tokens are decoded at the next sync
                self.set_next(None)
        self._drop_candidates()
        self.pending = None
        self.verified = {}

    def set_next(self, row: Any) -> None:
        """The logits row after the context (None: not known until the next sync)."""
        self.next_logits = row

    def count_synced(self, start: int) -> None:
        """Count tokens decoded by a sync from `start`: prompt tokens, or accepted text caught up."""
        in_prompt = max(0, min(self.n_cached, self.prompt_len) - start)
        self.stats.prompt += in_prompt
        self.stats.catch_up += self.n_cached - start - in_prompt

    # --- what each backend does its own way ---------------------------------------------
    @abstractmethod
    def sync(self) -> None:
        """Decode accepted tokens not yet cached, so that the row after the context is known."""

    @abstractmethod
    def _end_score(self) -> TokenScores:
        """The candidate "stop here": the probability of any end-of-generation token."""

    @abstractmethod
    def _verify(
        self, texts: list[str], encoded: list[list[int]] | None = None, keep_rows: bool = False
    ) -> dict[str, TokenScores]:
        """Decode new candidates on the cached prefix (`encoded`: their tokens, where given; else each text's
        continuation tokens); record them in ``verified`` (with their rows, `keep_rows`)."""

    def _pick(self, row: Any, sampling: Sampling, drafted: list[int]) -> int:
        """This member's own next token from `row` after `drafted` this round, as its drafting picks it
        (the constraint's mask, greedy or one draw from its generator); members that speculate implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot verify drafts for itself")

    def _token_score(self, row: Any, token: int) -> tuple[float, float]:
        """(log-probability, logit) of `token` in `row`."""
        raise NotImplementedError(f"{type(self).__name__} cannot verify drafts for itself")

    def _as_numpy(self, row: Any) -> np.ndarray:
        return np.asarray(row)

    @abstractmethod
    def _truncate(self, length: int) -> None:
        """Drop the context's cache cells from position `length` on."""

    @abstractmethod
    def _adopt(self, candidate: Verified, n_prefix: int) -> None:
        """Make a verified candidate's cells follow the context's first `n_prefix` tokens."""

    def _drop_candidates(self) -> None:
        """Free what verifying this round's candidates held (nothing, unless the backend keeps cells)."""


def top_alternatives(rows: Sequence[np.ndarray], k: int, piece: Callable[[int], bytes]) -> tuple[Alternatives, ...]:
    """The `k` most likely tokens (bytes, log-probability) of each logits row, most likely first."""
    out = []
    for row in rows:
        k_here = min(k, row.shape[-1])
        best = np.argpartition(row, -k_here)[-k_here:]
        best = best[np.argsort(row[best])[::-1]]
        peak = float(row.max())
        lse = peak + math.log(float(np.exp(row - peak, dtype=np.float64).sum()))
        out.append(tuple((piece(int(t)), float(row[t]) - lse) for t in best))
    return tuple(out)
