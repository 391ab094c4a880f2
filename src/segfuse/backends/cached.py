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
``_sync`` (decode accepted tokens not yet cached), ``_end_score``, ``_verify``,
``_truncate`` (drop cells from a position on), ``_adopt`` (keep a verified
candidate's cells) and ``_drop_candidates``.
"""

from __future__ import annotations

from abc import abstractmethod
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..constraints import Constraint, TokenMatcher, tokenizer_for
from ..errors import InvalidRequestError, PromptTooLongError
from ..models import PromptFormat
from ..prompting import prefill_of, raw_prompt
from ..segments import tokens_spelling
from ..types import Alternatives, Message, TokenScores
from .base import Member, MemberSession


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
    """A candidate decoded this round: its tokens, scores, and the row after its last token."""

    ids: list[int]
    scores: TokenScores
    last_row: Any


def _piece_or_empty(member: "LocalMember", token: int) -> bytes:
    try:
        return member.piece(token)
    except (IndexError, KeyError, ValueError, TypeError):  # padding rows past the tokenizer's own tokens
        return b""


class LocalMember(Member):
    """A member whose tokenizer and weights are here; it opens :class:`CachedSession` s."""

    n_ctx: int
    prompt: PromptFormat

    @abstractmethod
    def tokenize_plain(self, text: str) -> list[int]:
        """Ids of plain text: no special tokens added, special-token markup taken literally."""

    @abstractmethod
    def piece(self, token: int) -> bytes:
        """Text bytes of a token as it appears in an answer (control tokens are empty)."""

    @abstractmethod
    def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
        """The templated prompt's tokens."""

    vocab_size: int  # rows of its logits
    n_vocab: int  # ids with a text (logits rows past it, where there are any, are padding)
    eog_ids: Sequence[int]  # its end-of-generation tokens

    def check_ids(self, ids: Sequence[int]) -> None:
        """InvalidRequestError naming the first id outside the vocabulary (a native tokenizer given one
        may abort the process)."""
        bad = next((t for t in ids if not 0 <= int(t) < self.n_vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is not in {self.name}'s vocabulary (0 to {self.n_vocab - 1})",
                                      "give ids of this member's tokenizer (see /tokenize)", field="prompt")

    def tokenize_text(self, text: str) -> list[int]:
        return self.tokenize_plain(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        self.check_ids(tokens)
        return b"".join(self.piece(int(t)) for t in tokens).decode("utf-8", "replace")

    def token_matcher(self, constraint: Constraint, prefill: str = "") -> TokenMatcher:
        """A matcher of `constraint` over this member's tokens, after `prefill` (its vocabulary is read
        once, ~1 s)."""
        tokenizer = getattr(self, "_constraint_tokenizer", None)
        if tokenizer is None:
            pieces = [_piece_or_empty(self, t) for t in range(self.vocab_size)]
            tokenizer = self._constraint_tokenizer = tokenizer_for(pieces, [int(t) for t in self.eog_ids],
                                                                   self.tokenize_plain)
        return TokenMatcher(tokenizer, constraint, self.vocab_size, prefill)

    @abstractmethod
    def open_session(self, prompt: list[int], seed: int | None, cache_salt: str | None = None,
                     deterministic: bool = False) -> "CachedSession":
        """A session on a prompt known to fit; it reuses and keeps cached prefixes under `cache_salt` only
        (`deterministic`: see :meth:`Member.start`)."""

    def start(self, messages: Sequence[Message], *, seed: int | None, reserve: int,
              cache_salt: str | None = None, deterministic: bool = False) -> "CachedSession":
        prompt = self.prompt_tokens(messages)
        check_prompt_fits(self.name, len(prompt), reserve, self.n_ctx)
        session = self.open_session(prompt, seed, cache_salt, deterministic)
        session.raw = raw_prompt(messages) is not None
        session.prefill = prefill_of(messages)
        return session

    def spells(self, ids: Sequence[int], text: str) -> bool:
        return b"".join(self.piece(t) for t in ids) == text.encode("utf-8")

    def encode_continuation(self, text: str) -> list[int]:
        """Tokens that spell exactly `text` when appended to a context.

        SentencePiece-style vocabularies may add a leading-space marker to a
        text tokenized alone; anchoring on a newline avoids it.
        """
        ids = self.tokenize_plain(text)
        if self.spells(ids, text):
            return ids
        anchor, joined = self.tokenize_plain("\n"), self.tokenize_plain("\n" + text)
        if joined[: len(anchor)] == anchor and self.spells(joined[len(anchor) :], text):
            return joined[len(anchor) :]
        return ids


class CachedSession(MemberSession):
    """One request's context on a LocalMember; see the module docstring."""

    def __init__(self, member: LocalMember, prompt: list[int]) -> None:
        self.m = member
        self.cache_salt: str | None = None  # prefixes it reuses and keeps are under this salt only
        self.prompt_len = len(prompt)
        self.tokens: list[int] = list(prompt)
        self.n_cached = 0  # tokens[:n_cached] are in the cache
        self._next_row: Any = None  # logits after tokens, once cached
        self.stats = Counters()
        self._draft: DraftState | None = None
        self._verified: dict[str, Verified] = {}
        self._matcher: TokenMatcher | None = None  # under a constraint: what may be drafted next

    raw = False  # a text completion: the prompt format's stop strings do not apply
    prefill = ""  # the final assistant message the answer continues: a constraint reads it first

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.raw else self.m.prompt.stops

    @property
    def room(self) -> int:
        return self.m.n_ctx - len(self.tokens)

    def constrain(self, constraint: Constraint) -> None:
        self._matcher = self.m.token_matcher(constraint, self.prefill)

    def allowed_next(self, drafted: Sequence[int]) -> np.ndarray | None:
        """Under a constraint, the tokens that may follow the answer and the tokens `drafted` so far
        this round (a boolean mask over the vocabulary); None without one."""
        if self._matcher is None:
            return None
        self._matcher.follow([*self.answer_tokens(), *drafted])
        mask = self._matcher.allowed()
        if not mask.any():  # the answer is complete (or the grammar is stuck): only the end may come
            mask[np.asarray(self.m.eog_ids, dtype=np.int64)] = True
        return mask

    def counters(self) -> dict[str, int]:
        return self.stats.as_dict()

    def answer_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    # --- the template -------------------------------------------------------------
    def score(self, texts: Sequence[str]) -> list[TokenScores]:
        known, pending = self._known(texts)
        if pending:
            known.update(self._verify(pending))
        return [known[t] for t in texts]

    def _known(self, texts: Sequence[str]) -> tuple[dict[str, TokenScores], list[str]]:
        """Scores known without decoding, and the distinct texts still to verify (after a sync)."""
        self._sync()
        known = {t: v.scores for t, v in self._verified.items()}
        if "" in texts:
            known[""] = self._end_score()
        return known, [t for t in dict.fromkeys(texts) if t not in known]

    def accept(self, text: str) -> None:
        n_prefix = len(self.tokens)
        draft = self._draft
        kept = draft.kept_tokens(text) if (draft and text) else None
        if draft is not None and kept is not None:
            # Our own draft won: its tokens are already cached.
            decoded = min(kept, draft.n_decoded)
            self._truncate(n_prefix + decoded)
            self.tokens += draft.ids[:kept]
            self.n_cached = n_prefix + decoded
            self._set_next(draft.rows[kept] if decoded == kept else None)
        elif text and text in self._verified:
            # Another member's candidate won: its cells were computed while verifying.
            candidate = self._verified[text]
            self._truncate(n_prefix)
            self._adopt(candidate, n_prefix)
            self.tokens += candidate.ids
            self.n_cached = len(self.tokens)
            self._set_next(candidate.last_row)
        else:
            self._truncate(n_prefix)
            if text:
                self.tokens += self.m.encode_continuation(text)
                self.n_cached = min(self.n_cached, n_prefix)  # the new tokens are decoded at the next sync
                self._set_next(None)
        self._drop_candidates()
        self._draft = None
        self._verified = {}

    def _set_next(self, row: Any) -> None:
        self._next_row = row

    def _count_synced(self, start: int) -> None:
        """Count tokens decoded by a sync from `start`: prompt tokens, or accepted text caught up."""
        in_prompt = max(0, min(self.n_cached, self.prompt_len) - start)
        self.stats.prompt += in_prompt
        self.stats.catch_up += self.n_cached - start - in_prompt

    # --- what each backend does its own way ---------------------------------------------
    @abstractmethod
    def _sync(self) -> None:
        """Decode accepted tokens not yet cached, so that the row after the context is known."""

    @abstractmethod
    def _end_score(self) -> TokenScores:
        """The candidate "stop here": the probability of any end-of-generation token."""

    @abstractmethod
    def _verify(self, texts: list[str]) -> dict[str, TokenScores]:
        """Decode new candidates on the cached prefix; record them in ``_verified``."""

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
