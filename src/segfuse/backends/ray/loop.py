"""A copy's member thread: every call to its member runs here, calls that arrive together run as one batch,
and sessions no call touched for a while are closed.

A member's context serves one call at a time (a llama.cpp context is not thread-safe), so the
copy's callers (front ends in other processes, each with its own requests) queue :class:`CopyJob` s
and this thread takes them in turns. Whatever waits when it comes back for more is served
together: the other calls first (opening and closing sessions, accepting text: cheap), then every
draft in one ``draft_many`` and every score in one ``score_many``, as the scheduler batches one
process's calls (for llama.cpp one decode per token for every drafting session).

Gathering: two callers that take turns would never meet (each call arrives while the other's
runs, and runs alone next). So when a draft or score is about to run and sessions other than
its own were busy in the last second, the thread waits for their next calls, up to ``gather_s``
for each and 4 x ``gather_s`` in all; cheap calls that come meanwhile run at once, as the drafts
they precede would otherwise miss the batch. A lone session never waits.

After each batch the thread notes what the member holds (``seen``: its occupancy, the sessions,
the work done so far), before the batch's replies go out: whoever reads it after a reply sees
that reply's effect, and reading it never waits for the member.

Expiry: a session whose caller died (a front end killed mid-answer) is never closed by it; one
no call touched for ``expire_s`` is closed here, and its slot is free again. Its caller, if it
comes back, is told the session is lost (``SessionLost``) and reads it again.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from ...types import DraftTokens
from ..base import Member, MemberSession, Occupancy
from .wire import Done, SessionLost, portable

log = logging.getLogger("segfuse.backends.ray")

RECENT_S = 1.0  # sessions touched this recently are awaited when a batch gathers
GATHER_ROUNDS = 4  # a batch waits at most this many times gather_s in all

Kind = Literal["draft", "score", "call"]
Work = Callable[[Member, "SessionBook"], Done]  # a call job: what it does on the member thread


@dataclass(frozen=True)
class Seen:
    """What the member held after the thread's last batch, and the thread's work so far."""

    occupancy: Occupancy
    sessions: int
    stats: dict[str, int]


@dataclass(eq=False)
class CopyJob:
    """A caller's call: drafts (items ``(sid, max_tokens, sampling, wants_text)``), scores (items
    ``(sid, texts)``), or other work on the member; its Done comes back through `future`."""

    kind: Kind
    items: Sequence[tuple[Any, ...]] = ()
    work: Work | None = None
    on_text: Callable[[int, str], None] | None = None  # (item, text so far) of a draft that streams
    future: Future[Any] = field(default_factory=Future)
    sids: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.sids:
            self.sids = frozenset(item[0] for item in self.items)


class SessionBook:
    """The sessions open on a copy by id, and when a call last touched each (safe from any thread)."""

    def __init__(self, incarnation: str) -> None:
        self._prefix = incarnation[:8]
        self._ids = itertools.count(1)
        self._held: dict[str, MemberSession] = {}
        self._touched: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, session: MemberSession) -> str:
        sid = f"{self._prefix}-{next(self._ids)}"  # never reused, not even by a restarted copy
        with self._lock:
            self._held[sid] = session
            self._touched[sid] = time.monotonic()
        return sid

    def get(self, sid: str) -> MemberSession:
        with self._lock:
            session = self._held.get(sid)
            if session is None:
                raise SessionLost(
                    f"no session {sid} on this copy (it expired, or the copy restarted)", "read the session again"
                )
            self._touched[sid] = time.monotonic()
            return session

    def touch(self, sids: frozenset[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for sid in sids & self._held.keys():
                self._touched[sid] = now

    def pop(self, sid: str) -> MemberSession | None:
        with self._lock:
            self._touched.pop(sid, None)
            return self._held.pop(sid, None)

    def idle(self, since: float) -> list[str]:
        """Sessions no call touched since `since` (time.monotonic())."""
        with self._lock:
            return [sid for sid, at in self._touched.items() if at < since]

    def recent(self, since: float) -> set[str]:
        with self._lock:
            return {sid for sid, at in self._touched.items() if at >= since}

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class MemberLoop:
    """The thread that runs `member`'s calls; see the module docstring."""

    def __init__(self, member: Member, book: SessionBook, *, expire_s: float, gather_s: float) -> None:
        self.member, self.book = member, book
        self.expire_s, self.gather_s = expire_s, gather_s
        self.stats: Counter[str] = Counter()
        self._queue: queue.SimpleQueue[CopyJob] = queue.SimpleQueue()
        self.seen = Seen(member.occupancy(), 0, {})  # nothing decodes yet: safe to read here
        self._tick = min(1.0, expire_s / 4)  # how often an idle thread looks for expired sessions
        self._thread = threading.Thread(target=self._serve, name="segfuse-ray-member", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Calls queued for the thread now."""
        return self._queue.qsize()

    def submit(self, job: CopyJob) -> Future[Any]:
        """Queue `job`; its sessions count as touched from now (they cannot expire while it waits)."""
        self.book.touch(job.sids)
        self._queue.put(job)
        return job.future

    # --- the thread -----------------------------------------------------------------------------
    def _serve(self) -> None:  # for as long as the copy's process lives
        while True:
            jobs: list[CopyJob] = []
            try:
                self._take(jobs)
                self._settle(self._run(jobs))
                if self._expire(time.monotonic() - self.expire_s):
                    self._settle([])
            except Exception as exc:  # a bug here must not leave the copy deaf: these calls fail, it goes on
                log.exception("the member thread's step failed")
                self._fail(jobs, exc)

    def _fail(self, jobs: list[CopyJob], exc: Exception) -> None:
        """Reply `exc` to each of `jobs` not answered yet."""
        for job in jobs:
            if not job.future.done():
                n = max(1, len(job.items))
                job.future.set_result(Done([portable(exc)] * n, len(self.book), [None] * n))

    def _settle(self, replies: list[tuple[CopyJob, Done]]) -> None:
        """Note what the member holds now, then hand the replies out: a caller that has its reply reads
        a view at least as new (``seen``)."""
        try:
            seen = self.member.occupancy()
        except Exception:  # a view for operators must never stop the thread
            log.exception("could not read what the member holds")
            seen = Occupancy(self.member.slots)
        self.seen = Seen(seen, len(self.book), dict(self.stats))
        for job, done in replies:
            job.future.set_result(done)

    def _take(self, jobs: list[CopyJob]) -> None:
        """Into `jobs`: what waits now (after a tick's wait for the first), and what the gather brings."""
        taken = []
        try:
            taken.append(self._queue.get(timeout=self._tick))
        except queue.Empty:
            return
        while True:
            try:
                taken.append(self._queue.get_nowait())
            except queue.Empty:
                break
        jobs += [job for job in taken if self._running(job)]
        if self.gather_s > 0 and any(j.kind != "call" for j in jobs):
            self._gather(jobs)

    def _running(self, job: CopyJob) -> bool:
        """Mark `job` running (its caller can no longer cancel it, so its reply can always be set); False where
        its caller cancelled it while it waited (nobody waits for it: it is dropped)."""
        if job.future.set_running_or_notify_cancel():
            return True
        self.stats["dropped"] += 1
        return False

    def _gather(self, jobs: list[CopyJob]) -> None:
        """Wait a little for the next drafts and scores of sessions busy a moment ago (module docstring)."""
        now = time.monotonic()
        awaited = self.book.recent(now - RECENT_S) - {sid for job in jobs for sid in job.sids}
        until = now + GATHER_ROUNDS * self.gather_s
        while awaited:
            wait = min(self.gather_s, until - time.monotonic())
            if wait <= 0:
                return
            try:
                job = self._queue.get(timeout=wait)
            except queue.Empty:
                return
            if not self._running(job):
                continue
            if job.kind == "call":
                self._settle([self._call(job)])
                continue
            jobs.append(job)
            awaited -= job.sids
            self.stats["gathered"] += 1

    def _run(self, jobs: list[CopyJob]) -> list[tuple[CopyJob, Done]]:
        replies = [self._call(job) for job in jobs if job.kind == "call"]
        drafts = [job for job in jobs if job.kind == "draft"]
        if drafts:
            replies += self._batch(drafts, "draft", self.member.draft_many)
        scores = [job for job in jobs if job.kind == "score"]
        if scores:
            replies += self._batch(scores, "score", self.member.score_many)
        return replies

    def _call(self, job: CopyJob) -> tuple[CopyJob, Done]:
        assert job.work is not None
        self.stats["calls"] += 1
        try:
            done = job.work(self.member, self.book)
        except BaseException as exc:  # the caller gets it; the thread goes on
            done = Done([portable(exc)], len(self.book), [None])
        return job, done

    def _batch(self, jobs: list[CopyJob], kind: str, many: Callable[..., list[Any]]) -> list[tuple[CopyJob, Done]]:
        """Every item of `jobs` in one batched call; each job's Done holds its items' values."""
        values: dict[int, list[Any]] = {id(job): [None] * len(job.items) for job in jobs}
        sessions: list[MemberSession] = []
        requests: list[tuple[Any, ...]] = []
        where: list[tuple[CopyJob, int]] = []
        for job in jobs:
            for i, item in enumerate(job.items):
                try:
                    sessions.append(self.book.get(item[0]))
                except SessionLost as exc:
                    values[id(job)][i] = exc
                    continue
                requests.append(_request(job, i, item))
                where.append((job, i))
        if sessions:
            try:
                out = many(sessions, requests)
            except Exception as exc:  # the whole call failed: every session's result
                out = [exc] * len(sessions)
            for (job, i), value in zip(where, out):
                values[id(job)][i] = value
            self._count(kind, out)
        self.book.touch(frozenset(sid for job in jobs for sid in job.sids))
        load = len(self.book)
        return [
            (
                job,
                Done(
                    [portable(v) if isinstance(v, BaseException) else v for v in values[id(job)]],
                    load,
                    [None] * len(job.items),
                ),
            )
            for job in jobs
        ]

    def _count(self, kind: str, out: list[Any]) -> None:
        self.stats[f"{kind}_calls"] += len(out)
        self.stats[f"{kind}_batches"] += 1
        if kind == "draft":
            lengths = [len(d.pieces) for d in out if isinstance(d, DraftTokens)]
            # Decodes a batch takes: one per token step, shared by every drafting session (the last
            # sampled token is not fed); apart, each session would have taken its own.
            self.stats["draft_tokens"] += sum(lengths)
            self.stats["draft_decodes"] += max((n - 1 for n in lengths), default=0)
            self.stats["draft_decodes_apart"] += sum(max(0, n - 1) for n in lengths)

    def _expire(self, before: float) -> int:
        """Close the sessions no call touched since `before`; how many."""
        expired = 0
        for sid in self.book.idle(before):
            session = self.book.pop(sid)
            if session is None:
                continue
            try:
                session.close()
            except Exception:
                log.exception("closing an expired session failed")
            self.stats["expired"] += 1
            expired += 1
        return expired


def _request(job: CopyJob, index: int, item: tuple[Any, ...]) -> tuple[Any, ...]:
    """A draft item as ``draft``'s positional arguments (with a hook that streams its text where asked), or a
    score item as ``score``'s."""
    if job.kind == "score":
        return (item[1],)
    _, max_tokens, sampling, wants_text = item
    if not wants_text or job.on_text is None:
        return (max_tokens, sampling)
    on_text = job.on_text
    return (max_tokens, sampling, lambda text: on_text(index, text))
