"""Member calls as data, and running them: one by one, concurrently, or batched.

The engine never calls a member or a session itself: it yields ``Calls``
(which method of which session, with which arguments) and is sent back one
``Reply`` per call. That keeps the per-request logic in one place while a
driver decides how the work runs:

- one generation (:func:`segfuse.engine.fuse`): the calls of one step, members
  on the CPU one after another, members that run side by side
  (``parallel_safe``: remote servers, llama.cpp members wholly on a GPU) in
  threads;
- many generations (``scheduler.py``): the same, but calls of several requests
  to one member that batches (``Capabilities.batched``) go into one batched
  call, e.g. one ``llama_decode`` for every session's token.

The one exception is closing a generation early (cancelled, failed): a closed
coroutine cannot yield, so it closes its sessions directly.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import methodcaller
from typing import Any, Literal

from ..backends.base import Member, MemberSession

Method = Literal[
    "start",
    "constrain",
    "draft",
    "score",
    "speculate",
    "accept",
    "text_logprob",
    "counters",
    "close",
    "draft_many",
    "score_many",
]
# Calls that decode nothing (opening a session tokenizes; accepting edits caches and token lists):
# a scheduler runs them at once instead of spending a tick on them.
CHEAP: frozenset[str] = frozenset({"start", "accept", "counters", "close"})
BATCHED: dict[str, Method] = {"draft": "draft_many", "score": "score_many"}  # what a batching member serves together
# Calls that read or write answer text (drafts, scores, prompt fits): the member calls a generation reports.
COUNTED: frozenset[str] = frozenset({"draft", "score", "speculate", "text_logprob"})


@dataclass(frozen=True)
class Call:
    """``session.<method>(*args)``, or ``member.<method>(...)`` when `session` is None (``start``)."""

    member: Member
    session: MemberSession | None
    method: Method
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def cheap(self) -> bool:
        return self.method in CHEAP

    def invoke(self) -> Any:
        target = self.member if self.session is None else self.session
        return methodcaller(self.method, *self.args, **self.kwargs)(target)


@dataclass(frozen=True)
class Calls:
    """What a generation needs done before it can go on (yielded by the engine)."""

    calls: list[Call]

    @property
    def cheap(self) -> bool:
        return all(call.cheap for call in self.calls)


@dataclass(frozen=True)
class Reply:
    """A call's result, or the exception it raised, and how long its caller waited."""

    value: Any
    seconds: float

    @property
    def failed(self) -> bool:
        return isinstance(self.value, Exception)


Asking = Generator[Calls, list[Reply], Any]  # a step of a generation: it yields calls, is sent their replies


class MemberPanic(Exception):
    """A member call raised what is not an ``Exception``: a native library's panic (pyo3 raises a
    ``BaseException``). It is that member's fault like any other, not the end of the process."""


def _timed(call: Call) -> Reply:
    t0 = time.perf_counter()
    try:
        value = call.invoke()
    except Exception as exc:  # a member's failure is data: the engine drops that member
        value = exc
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:
        value = MemberPanic(f"{type(exc).__name__}: {exc}")
        value.__cause__ = exc
    return Reply(value, time.perf_counter() - t0)


def _lanes(calls: Sequence[Call], groups: list[list[int]]) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The groups the calling thread runs, and the lanes (each a list of groups) that run beside them:
    one per call of a parallel-safe member that does not batch, one per parallel-safe member that does."""
    here: list[list[int]] = []
    lanes: list[list[list[int]]] = []
    own: dict[int, list[list[int]]] = {}
    for indices in groups:
        member = calls[indices[0]].member
        if not member.capabilities.parallel_safe:
            here.append(indices)
        elif member.capabilities.batched:
            own.setdefault(id(member), []).append(indices)
        else:
            lanes += [[[i]] for i in indices]
    return here, lanes + list(own.values())


class CallRunner:
    """Runs a list of calls and returns one Reply per call, in order.

    Calls to members that declare ``parallel_safe`` run beside the others: a
    remote server's calls each in a thread of their own (its sessions share
    only a pooled HTTP client); a batching member's calls (a llama.cpp member
    on its own GPU) all in one thread, one group after another, since its
    context serves one decode at a time. Every other member's calls run on the
    calling thread, one after another: members sharing the CPU would only
    contend. No thread is used when only one of these lanes has work. Several
    draft or score calls to one member that batches are made as one batched
    call.
    """

    def __init__(self, max_threads: int = 16) -> None:
        self.max_threads = max_threads
        self._pool: ThreadPoolExecutor | None = None

    def run(self, calls: Sequence[Call]) -> list[Reply]:
        groups: dict[tuple[int, str], list[int]] = {}
        for i, call in enumerate(calls):
            groups.setdefault((id(call.member), call.method), []).append(i)
        here, lanes = _lanes(calls, list(groups.values()))
        replies: list[Reply | None] = [None] * len(calls)
        if len(lanes) + bool(here) <= 1:  # one lane: nothing to overlap with, no thread
            here, lanes = here + [g for lane in lanes for g in lane], []
        futures = [self._threads().submit(self._run_lane, calls, lane, replies) for lane in lanes]
        self._run_lane(calls, here, replies)
        for future in futures:
            future.result()
        return [r for r in replies if r is not None]

    def _run_lane(self, calls: Sequence[Call], lane: list[list[int]], replies: list[Reply | None]) -> None:
        """Each group of calls (one member, one method) in turn, on this thread."""
        for indices in lane:
            self._run_local([calls[i] for i in indices], indices, replies)

    def _run_local(self, group: list[Call], indices: list[int], replies: list[Reply | None]) -> None:
        first = group[0]
        if len(group) == 1 or not first.member.capabilities.batched or first.method not in BATCHED:
            for i, call in zip(indices, group):
                replies[i] = _timed(call)
            return
        # One batched call: every session waited for the whole of it.
        batch = Call(first.member, None, BATCHED[first.method], ([c.session for c in group], [c.args for c in group]))
        whole = _timed(batch)
        values = whole.value if not whole.failed else [whole.value] * len(group)
        for i, value in zip(indices, values):
            replies[i] = Reply(value, whole.seconds)

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_threads, thread_name_prefix="segfuse-member")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> CallRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
