"""The answer so far: its text, its segments and rounds, its statistics, and how it streams.

Each round's winner joins the transcript and goes out as a ``SegmentEvent``;
when the leader answers alone, the round's text went out as the leader wrote
it (``live.py``) and only the rest goes out at the round's end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

from ..types import Event, RoundRecord, Segment, SegmentEvent, Stats
from .context import Round
from .live import LeaderStream

log = logging.getLogger("segfuse.engine")


class Transcript:
    """The answer as the rounds write it, after the prefill it continues (a final assistant message)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.prefill = ""  # set when the generation starts: the final assistant message, or ""
        self.text = ""
        self.segments: list[Segment] = []
        self.rounds: list[RoundRecord] = []
        self.stats = Stats(wins=dict.fromkeys(names, 0))
        self.live: LeaderStream | None = None  # this round's, when the leader answers alone
        self.started = time.perf_counter()

    @property
    def message(self) -> str:
        """The whole assistant message so far: the prefill and the answer (what stop strings, the
        constraint and the guard read)."""
        return self.prefill + self.text

    @property
    def last(self) -> str:
        """The last segment's text ("" before the first)."""
        return self.segments[-1].text if self.segments else ""

    def round(self, round_no: int, max_tokens: int) -> Round:
        """Where round `round_no` starts, with `max_tokens` the whole answer's budget."""
        return Round(round_no, self.message, self.last, max_tokens - self.stats.tokens)

    def stream(self, leader: str, round_no: int, stops: tuple[str, ...]) -> LeaderStream:
        """This round's segment as the leader writes it (it answers alone)."""
        self.live = LeaderStream(leader, round_no, self.message, stops)
        return self.live

    def keep_streamed(self, round_no: int) -> None:
        """What went out of a leader that then failed stays in the answer: its successor goes on from it."""
        live, self.live = self.live, None
        if live is not None and live.sent:
            self.text += live.sent
            self.segments.append(Segment(text=live.sent, model=live.model, round=round_no))

    def append(self, record: RoundRecord, calls: int) -> Iterator[Event]:
        """The winner joins the answer and goes out at once (what is left of it, if it went out as written)."""
        chosen, stats = record.candidates[record.winner_index], self.stats
        self.text += chosen.text
        stats.rounds = record.index
        stats.wins[chosen.model] += 1
        stats.tokens += chosen.n_tokens
        stats.gated_rounds += record.gated
        stats.model_calls = calls
        live, self.live = self.live, None
        if live is not None and live.first_at is not None and stats.time_to_first_segment_s is None:
            stats.time_to_first_segment_s = live.first_at - self.started
        if not chosen.text:
            return
        segment = Segment(text=chosen.text, model=chosen.model, round=record.index, trail=chosen.trail)
        self.segments.append(segment)
        if stats.time_to_first_segment_s is None:
            stats.time_to_first_segment_s = time.perf_counter() - self.started
        sent = live.sent if live is not None else ""
        if not sent:
            yield SegmentEvent(segment)
        elif chosen.text.startswith(sent):  # the rest of what went out as the leader wrote it
            if len(chosen.text) > len(sent):
                yield SegmentEvent(Segment(text=chosen.text[len(sent) :], model=chosen.model, round=record.index))
        else:  # never expected: what went out is always kept
            log.error(
                "round %d: the streamed text %r is not where the segment %r starts", record.index, sent, chosen.text
            )
            yield SegmentEvent(segment)
