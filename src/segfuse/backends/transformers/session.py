"""One request's context on a transformers member: one ``DynamicCache`` (the layout is in
``member.py``'s docstring), drafting with temperature + nucleus sampling, verifying every
candidate in one forward pass. It works with the member's parts: the vocabulary, the weights,
and the prefixes kept between requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from ...errors import PromptTooLongError
from ...types import DraftTokens, Sampling, Speculation, TokenScores
from ..base import OnText
from ..cached import CachedSession, DraftState, Verified, top_alternatives
from ..compute import on_compute
from ..drafting import DraftProgress
from .prefixes import StoredPrefixes, attention_layers, keys_values
from .tokens import Vocabulary
from .weights import Weights


def sample(
    row: torch.Tensor, sampling: Sampling, generator: torch.Generator | None, banned: torch.Tensor | None = None
) -> int:
    """Temperature + nucleus sampling on one logits row (float32); greedy at temperature 0.

    `banned` token ids are never picked (end-of-generation under Sampling.ignore_eos).
    """
    if banned is not None:
        row = row.index_fill(0, banned.to(row.device), float("-inf"))
    if sampling.greedy:
        return int(row.argmax())
    probs = torch.softmax(row / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = (sorted_probs.cumsum(0) - sorted_probs) < sampling.top_p  # always keeps the top token
        picked = torch.multinomial(sorted_probs * keep, 1, generator=generator)
        return int(order[picked])
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class _KeysValues(Verified):
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer: this candidate's cached keys/values
    values: list[torch.Tensor] = field(default_factory=list)


def _crop(cache: DynamicCache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # negative = tokens to remove; accepted by old and new transformers


def _scores_at(rows: torch.Tensor, targets: Sequence[int]) -> TokenScores:
    """Log-probabilities and logits of `targets` in `rows`, and each row's most likely token's log-probability."""
    index = torch.tensor(list(targets), device=rows.device)[:, None]
    picked = rows.gather(1, index)[:, 0]
    lse = torch.logsumexp(rows, dim=-1)
    tops = rows.max(dim=-1).values - lse
    return TokenScores(tuple((picked - lse).tolist()), tuple(picked.tolist()), tuple(tops.tolist()))


class Drafting(DraftProgress[torch.Tensor]):
    """One session's draft in progress: sample from the current row, feed the token, repeat (alone, or in a
    batch of sessions: ``batch.py``). The last sampled token is never fed."""

    def __init__(self, session: TransformersSession, n: int, sampling: Sampling, on_text: OnText | None = None) -> None:
        super().__init__(n, sampling, on_text, start=len(session.tokens))
        self.session = session
        self.row: torch.Tensor = session.next_logits
        self.banned = session.eog if sampling.ignore_eos else None

    def step(self) -> bool:
        """Sample the next token; True when it must be fed for the draft to go on."""
        if self.done:
            return False
        session, row = self.session, self.row
        allowed = session.allowed_next(self.ids)  # under a constraint; scores stay the model's own
        if allowed is not None:
            row = row.masked_fill(~torch.from_numpy(allowed).to(row.device), float("-inf"))
        token = sample(row, self.sampling, session.generator, self.banned)
        lse = float(torch.logsumexp(self.row, dim=-1))
        finished = session.vocab.is_eog(token)
        going_on = self.took(self.row, token, float(self.row[token]), lse, finished)
        self.text.add(b"" if finished else session.vocab.piece(token))
        return going_on

    def fed(self, row: torch.Tensor) -> None:
        """The last token was decoded: `row` is the logits row after it."""
        self.row = row
        self.count_fed(self.session.stats)

    def finish(self) -> DraftTokens:
        """The draft as the engine takes it; its tokens stay pending in the session until ``accept``."""
        vocab = self.session.vocab

        def piece(token: int) -> bytes:
            return b"" if vocab.is_eog(token) else vocab.piece(token)

        pieces = [piece(t) for t in self.ids]
        self.session.pending = DraftState(self.ids, pieces, self.rows)
        k = self.sampling.top_logprobs
        tops = top_alternatives([r.float().cpu().numpy() for r in self.rows], k, piece) if k else ()
        return self.tokens(pieces, tops)


class TransformersSession(CachedSession):
    """One request's context on a TransformersMember: one DynamicCache, run by `weights`; on closing, its
    keys and values go to `prefixes`. See the module docstring."""

    streams_text = True  # its draft calls on_text as it samples

    def __init__(
        self, prompt: list[int], seed: int | None, *, vocab: Vocabulary, weights: Weights, prefixes: StoredPrefixes
    ) -> None:
        super().__init__(vocab, prompt, n_ctx=weights.n_ctx, stops=vocab.prompt.stops)
        self.vocab: Vocabulary = vocab
        self.weights = weights
        self.prefixes = prefixes
        self.compute = weights.compute  # every call runs on the device's compute thread (``compute.py``)
        self.deterministic = False  # it never shares a forward pass with other sessions (``batch.py``)
        self.eog = torch.tensor(vocab.eog_ids, device=weights.input_device)
        self.cache = DynamicCache()  # full layers: sliding windows are enforced by the masks, and cropping works
        self.generator: torch.Generator | None = None
        if seed is not None:
            device = weights.input_device
            self.generator = torch.Generator(device="cpu" if device.type == "cpu" else device).manual_seed(seed)

    def sync(self) -> None:
        start = self.n_cached
        if start < len(self.tokens):
            rows = self.weights.forward(self.cache, self.tokens[start:], range(start, len(self.tokens)), last_only=True)
            self.stats.decode_calls += 1
            self.n_cached = len(self.tokens)
            self.next_logits = rows[-1]
            self.count_synced(start)
        if self.next_logits is None:
            raise RuntimeError("context is empty")

    def prepare_draft(self) -> None:
        """Drop an earlier draft that was never accepted, and decode what the context still lacks."""
        self._drop_pending()
        self.sync()

    def _drop_pending(self) -> None:
        if self.pending is not None:
            _crop(self.cache, len(self.tokens))
            self.pending, self.verified = None, {}

    @on_compute
    def draft(self, max_tokens: int, sampling: Sampling, on_text: OnText | None = None) -> DraftTokens:
        self.prepare_draft()
        drafting = Drafting(self, max_tokens, sampling, on_text)
        while drafting.step():
            drafting.fed(self.weights.forward(self.cache, [drafting.ids[-1]], [drafting.pos])[-1])
        return drafting.finish()

    @on_compute
    def score(self, texts: Sequence[str]) -> list[TokenScores]:
        return super().score(texts)

    @on_compute
    def accept(self, text: str) -> None:
        super().accept(text)

    @on_compute
    def speculate(self, drafts: Sequence[str], max_tokens: int, sampling: Sampling) -> Speculation:
        # Not synced first: the context's tokens not decoded yet lead the drafts in their one pass.
        self._drop_pending()
        return super().speculate(drafts, max_tokens, sampling)

    def _pick(self, row: torch.Tensor, sampling: Sampling, drafted: list[int]) -> int:
        allowed = self.allowed_next(drafted)  # as ``Drafting.step`` picks
        if allowed is not None:
            row = row.masked_fill(~torch.from_numpy(allowed).to(row.device), float("-inf"))
        return sample(row, sampling, self.generator, self.eog if sampling.ignore_eos else None)

    def _token_score(self, row: torch.Tensor, token: int) -> tuple[float, float]:
        logit = float(row[token])
        return logit - float(torch.logsumexp(row, dim=-1)), logit

    def _as_numpy(self, row: torch.Tensor) -> np.ndarray:
        return row.float().cpu().numpy()

    def _end_score(self) -> TokenScores:
        row = self.next_logits
        eog = row[self.eog.to(row.device)]
        lse = torch.logsumexp(row, 0)
        lp = float(torch.logsumexp(eog, 0) - lse)
        return TokenScores((lp,), (float(eog.max()),), (float(row.max() - lse),))

    def _verify(
        self, texts: list[str], encoded: list[list[int]] | None = None, keep_rows: bool = False
    ) -> dict[str, TokenScores]:
        """All candidates in one forward pass; their keys/values are kept aside for accept."""
        weights, n_prefix, prefix_row = self.weights, len(self.tokens), self.next_logits
        encoded = encoded if encoded is not None else [self.vocab.encode_continuation(t) for t in texts]
        lengths = [len(ids) for ids in encoded]
        if n_prefix + sum(lengths) > self.n_ctx:
            raise PromptTooLongError(f"{self.vocab.name}: the candidates do not fit the context", "lower --window")
        n_cache = self.cache.get_seq_length()  # prefix + this round's pending draft tokens
        mask = weights.block_mask(n_prefix, n_cache - n_prefix, lengths)
        positions = [n_prefix + i for n in lengths for i in range(n)]
        rows = weights.forward(self.cache, [t for ids in encoded for t in ids], positions, mask=mask)
        self.stats.verify += sum(lengths)
        self.stats.verify_calls += 1
        self.stats.decode_calls += 1
        layers = [keys_values(layer) for layer in attention_layers(self.cache)]
        keys = [k[..., n_cache:, :] for k, _ in layers]
        values = [v[..., n_cache:, :] for _, v in layers]
        _crop(self.cache, n_cache)
        at = 0
        for text, ids in zip(texts, encoded):
            block = rows[at : at + len(ids)]
            # (no prefix row when the candidates start with the context's last tokens: speculating)
            first = prefix_row[None, :] if prefix_row is not None else block[:1]
            predictors = torch.cat([first, block[:-1]])
            span = slice(at, at + len(ids))
            self.verified[text] = _KeysValues(
                ids,
                _scores_at(predictors, ids),
                block[-1],
                torch.cat([predictors, block[-1:]]) if keep_rows else None,
                [k[..., span, :] for k in keys],
                [v[..., span, :] for v in values],
            )
            at += len(ids)
        return {t: self.verified[t].scores for t in texts}

    def _truncate(self, length: int) -> None:
        _crop(self.cache, length)

    def _adopt(self, candidate: Verified, n_prefix: int) -> None:
        assert isinstance(candidate, _KeysValues)
        for layer, k, v in zip(attention_layers(self.cache), candidate.keys, candidate.values):
            keys, values = keys_values(layer)
            layer.keys = torch.cat([keys, k], dim=-2)
            layer.values = torch.cat([values, v], dim=-2)

    @on_compute
    def close(self) -> None:
        """Drop the context; its first ``n_cached`` positions stay in the member's prefix cache."""
        if self.n_cached and self.cache.get_seq_length() >= self.n_cached:
            self.prefixes.keep(self.cache, self.tokens[: self.n_cached], self.cache_salt)
        self.cache = DynamicCache()
        self.n_cached = 0
        self.verified = {}
