"""The bookkeeping of one session's draft in progress, shared by the local backends' drafting loops
(llama.cpp's numpy rows, transformers' torch rows): what was sampled, from which row, at what
log-probability, and whether the draft is over."""

from __future__ import annotations

import math
from typing import Generic, TypeVar

from ..types import Alternatives, DraftTokens, Sampling
from .base import OnText, TextSoFar
from .cached import Counters

Row = TypeVar("Row")  # one logits row, in the backend's own array type


class DraftProgress(Generic[Row]):
    """A draft of at most `n` tokens: each sampled token with the row it came from; its text goes to
    `on_text` as it grows. A backend's drafting loop samples and feeds; this keeps the record."""

    def __init__(self, n: int, sampling: Sampling, on_text: OnText | None, start: int) -> None:
        self.n, self.sampling = n, sampling
        self.text = TextSoFar(on_text)
        self.pos = start  # where the next fed token goes
        self.ids: list[int] = []
        self.rows: list[Row] = []  # rows[j]: the logits row that sampled ids[j]
        self.logprobs: list[float] = []
        self.logits: list[float] = []
        self.finished = False
        self.done = n <= 0

    def took(self, row: Row, token: int, logit: float, lse: float, finished: bool) -> bool:
        """Record `token`, sampled from `row` (whose log-sum-exp is `lse`); True when the draft goes on."""
        self.rows.append(row)
        self.ids.append(token)
        self.logits.append(logit)
        self.logprobs.append(logit - lse)
        self.finished = finished
        unsure = self.sampling.stop_below > 0 and logit - lse < math.log(self.sampling.stop_below)
        self.done = finished or unsure or len(self.ids) >= self.n
        return not self.done

    def count_fed(self, stats: Counters) -> None:
        """The last token was decoded: one more draft token, in one more decode call."""
        self.pos += 1
        stats.draft += 1
        stats.decode_calls += 1

    def tokens(self, pieces: list[bytes], tops: tuple[Alternatives, ...]) -> DraftTokens:
        """The draft as the engine takes it."""
        return DraftTokens(tuple(pieces), tuple(self.logprobs), tuple(self.logits), self.finished, tops)
