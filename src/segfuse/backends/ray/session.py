"""One request's session on a Ray member: pinned to the copy that holds its cache, read again elsewhere
when that copy is lost.

The session remembers what it needs to be read again: the messages and start options, the
constraint, and the answer accepted so far. When its copy is gone (``CopyLost``) or no longer holds
it (``SessionLost``: it expired, or Ray restarted the copy), :meth:`RaySession.recover` opens a
session on another live copy (the same copy where only the session was lost), constrains it,
accepts the answer so far, and the call is made again there. Where no copy is left the call
raises, as a member's fault does: the engine's failover takes over.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from ...errors import NoFreeSlotError
from ...types import DraftTokens, Message, Sampling, TokenScores
from ..base import MemberSession, OnText
from .affinity import prefix_keys
from .copies import Copies, Copy
from .wire import CopyLost, Opened, SessionLost

if TYPE_CHECKING:
    from collections import Counter

    from ...constraints import Constraint


class Owner(Protocol):
    """What a session uses of its member (``member.RayMember``): its copies and its batched calls."""

    name: str
    copies: Copies
    stats: Counter[str]

    def draft_many(self, sessions: Sequence[RaySession], requests: Sequence[Any]) -> list[Any]: ...

    def score_many(self, sessions: Sequence[RaySession], requests: Sequence[Any]) -> list[Any]: ...


SLOT_WAIT_S = 30.0  # how long opening a session waits for a free slot on some copy (as a local member does)


class RaySession(MemberSession):
    """A session on one copy of a Ray member (module docstring)."""

    def __init__(self, member: Owner, messages: Sequence[Message], start: dict[str, Any]) -> None:
        self.m = member
        self.messages = list(messages)
        self.start = start  # Member.start's keyword arguments
        self.keys = prefix_keys(self.messages)
        self.answer = ""  # accepted so far: what a copy that reads the session again accepts at once
        self.constraint: Constraint | None = None
        self.copy: Copy | None = None
        self.sid = ""
        self._room = 0
        self._stops: tuple[str, ...] = ()
        self.streams_text = False
        self.closed = False

    @property
    def stops(self) -> tuple[str, ...]:
        return self._stops

    @property
    def room(self) -> int:
        return self._room

    # --- opening, and reading again -------------------------------------------------------------
    def open(self, exclude: Sequence[Copy] = ()) -> None:
        """Open on the best copy (copies.py) that takes it; while every copy is full, wait up to
        ``SLOT_WAIT_S`` for a slot. CopyLost where no copy is left."""
        deadline = time.monotonic() + SLOT_WAIT_S
        pause = 0.05
        while True:
            full: NoFreeSlotError | None = None
            for copy in self.m.copies.choose(self.keys, exclude):
                try:
                    opened = self.m.copies.get(copy, copy.handle.start.remote(self.messages, self.start))
                except CopyLost:
                    continue
                except NoFreeSlotError as exc:
                    full = exc
                    continue
                self._opened(copy, opened)
                return
            if full is None:
                raise CopyLost(
                    f"no copy of {self.m.name} is left to read the session",
                    "the member leaves the answer; Ray restarts its copies where it can",
                )
            if time.monotonic() > deadline:
                raise full
            time.sleep(pause)
            pause = min(2 * pause, 0.5)

    def _opened(self, copy: Copy, opened: Opened) -> None:
        self.copy, self.sid = copy, opened.sid
        self._room, self._stops, self.streams_text = opened.room, opened.stops, opened.streams_text
        self.m.copies.affinity.remember(self.keys, copy.index)

    def recover(self, lost: Copy | None) -> None:
        """Read the session again (module docstring): on a copy other than `lost` (gone), or on any live
        copy where only the session was lost."""
        exclude = [lost] if lost is not None else []
        while True:
            self.open(exclude)
            try:
                if self.constraint is not None:
                    self._once("constrain", (self.constraint,))
                if self.answer:
                    self._once("accept", (self.answer,))
            except (CopyLost, SessionLost):
                exclude.append(self.copy)  # type: ignore[arg-type]  # open() has just set it
                continue
            self.m.stats["reread"] += 1
            return

    # --- calls ------------------------------------------------------------------------------------
    def _once(self, method: str, args: tuple[Any, ...]) -> Any:
        """``method`` on this session's copy, as it is (CopyLost or SessionLost where it is gone)."""
        assert self.copy is not None
        done = self.m.copies.wait(self.copy, self.copy.handle.session.remote(self.sid, method, args))
        value = done.values[0]
        if isinstance(value, BaseException):
            raise value
        if done.rooms[0] is not None:
            self._room = done.rooms[0]
        return value

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        """``method`` on the session, read again elsewhere (and the call made again) when it was lost."""
        for _ in range(len(self.m.copies.all) + 1):
            copy = self.copy
            try:
                return self._once(method, args)
            except SessionLost:
                self.recover(None)
            except CopyLost:
                self.recover(copy)
        raise CopyLost(f"{self.m.name}: the session was lost on every copy", "the member leaves the answer")

    def draft(self, max_tokens: int, sampling: Sampling, on_text: OnText | None = None) -> DraftTokens:
        return cast(DraftTokens, _value(self.m.draft_many([self], [(max_tokens, sampling, on_text)])[0]))

    def score(self, texts: Sequence[str]) -> list[TokenScores]:
        return cast(list[TokenScores], _value(self.m.score_many([self], [(texts,)])[0]))

    def accept(self, text: str) -> None:
        self.call("accept", (text,))
        self.answer += text

    def constrain(self, constraint: Constraint) -> None:
        self.call("constrain", (constraint,))
        self.constraint = constraint

    def text_logprob(self, text: str) -> tuple[float, int]:
        return cast(tuple[float, int], self.call("text_logprob", (text,)))

    def counters(self) -> dict[str, int]:
        return cast(
            dict[str, int], self._once("counters", ())
        )  # work on a copy that is gone is gone with it: not read again

    def close(self) -> None:
        """Close on the copy (nothing to free where it is gone); its answer's prefix is that copy's now."""
        if self.closed or self.copy is None:
            return
        self.closed = True
        try:
            self._once("close", ())
        except (CopyLost, SessionLost):
            return
        self.m.copies.affinity.remember(
            prefix_keys([*self.messages, Message("assistant", self.answer)]), self.copy.index
        )


def _value(value: Any) -> Any:
    if isinstance(value, BaseException):
        raise value
    return value
