"""Member calls as data, and running them: one by one, concurrently, or batched.

The engine never calls a member session itself: it yields ``Calls`` (which
method of which session, with which arguments) and is sent back one ``Reply``
per call. That keeps the per-request logic in one place while a driver decides
how the work runs:

- one generation (:func:`specfuse.engine.fuse`): the calls of one round, local
  members one after another, remote (``parallel_safe``) members in threads;
- many generations (``scheduler.py``): the same, but calls of several requests
  to one member that can batch (``Member.draft_many`` / ``score_many``) go
  into one batched call, e.g. one ``llama_decode`` for every session's token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .backends.base import Member, MemberSession


@dataclass(frozen=True)
class Call:
    """``session.<method>(*args)`` on a session of ``member``."""

    member: Member
    session: MemberSession
    method: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Calls:
    """What a generation needs done before it can go on (yielded by the engine)."""

    calls: list[Call]


@dataclass(frozen=True)
class Reply:
    """A call's result, or the exception it raised, and how long its caller waited."""

    value: Any
    seconds: float

    @property
    def failed(self) -> bool:
        return isinstance(self.value, Exception)


def _timed(fn: Any, *args: Any) -> Reply:
    t0 = time.perf_counter()
    try:
        value = fn(*args)
    except Exception as exc:  # a member's failure is data: the engine drops that member
        value = exc
    return Reply(value, time.perf_counter() - t0)


def _batch_of(member: Member, method: str) -> Any:
    """The member's batched form of `method` (``draft_many``, ``score_many``), if it has one."""
    return getattr(member, f"{method}_many", None)


class CallRunner:
    """Runs a list of calls and returns one Reply per call, in order.

    Calls to members that set ``parallel_safe = True`` (remote servers) run in
    a thread pool while local ones run on the calling thread, so network waits
    overlap with local CPU work and with each other. Several calls of one
    method to one member that can batch are made as one batched call.
    """

    def __init__(self, max_threads: int = 16) -> None:
        self.max_threads = max_threads
        self._pool: ThreadPoolExecutor | None = None

    def run(self, calls: Sequence[Call]) -> list[Reply]:
        groups: dict[tuple[int, str], list[int]] = {}
        for i, call in enumerate(calls):
            groups.setdefault((id(call.member), call.method), []).append(i)
        replies: list[Reply | None] = [None] * len(calls)
        futures: dict[int, Future[Reply]] = {}
        local: list[list[int]] = []
        for indices in groups.values():
            member = calls[indices[0]].member
            if getattr(member, "parallel_safe", False) and len(calls) > 1:
                for i in indices:
                    c = calls[i]
                    futures[i] = self._threads().submit(_timed, getattr(c.session, c.method), *c.args)
            else:
                local.append(indices)
        for indices in local:
            self._run_local([calls[i] for i in indices], indices, replies)
        for i, future in futures.items():
            replies[i] = future.result()
        return [r for r in replies if r is not None]

    def _run_local(self, group: list[Call], indices: list[int], replies: list[Reply | None]) -> None:
        batched = _batch_of(group[0].member, group[0].method) if len(group) > 1 else None
        if batched is None:
            for i, c in zip(indices, group):
                replies[i] = _timed(getattr(c.session, c.method), *c.args)
            return
        # One batched call: every session waited for the whole of it.
        whole = _timed(batched, [c.session for c in group], [c.args for c in group])
        values = whole.value if not whole.failed else [whole.value] * len(group)
        for i, value in zip(indices, values):
            replies[i] = Reply(value, whole.seconds)

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_threads, thread_name_prefix="specfuse-member")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "CallRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
