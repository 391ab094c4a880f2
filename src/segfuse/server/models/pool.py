"""Members loaded when a request needs them and freed when idle: the server's pool.

Every member the catalog names has a place here: unloaded, loading, loaded, unloading or failed (its
last load's error; the next request tries again). A request takes a lease on its model's members
(``Pool.lease``): when they are all loaded it pins them at once; else it waits its turn (one request
loads at a time, at most ``queue_size`` wait: 429 beyond), then pins them, makes room within the
budget and loads what is missing, off the event loop, while loaded models go on being served; while a
load waits for members in use to be let go, newer requests that would pin another loaded member wait
behind it (first come, first served between models: a busy model cannot starve a load). Each
job the request queues holds the lease again until the worker lets the job go (``submit``), so a
member in use is never freed. When the last holder lets a member go, it stays for its keep-alive
(the request's ``keep_alive``, else the server's; members of preloaded models: until a request says
otherwise), then a reaper frees it; past the budget (``max_loaded_members``, ``max_loaded_bytes``) the
least recently used idle member goes first. The members join and leave the worker's ensemble under
the pool's lock; a member leaves, and closes, on the worker thread between two steps, where nothing
can be decoding with it. A request that must wait (for a member to finish closing, or for one in use to be
let go to make room) sleeps until the pool changes: every change, on whichever thread, wakes it through the
event loop (``Changes``). What goes wrong is said in domain errors (QueueFullError, and ``places.py``'s
MemberFreedError, LoadFailedError, NoRoomError), which the server's edge (``serving.api_error``) gives
their HTTP status. A place and the rules of room are in ``places.py``; the waiting in ``changes.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from functools import partial

from ...backends.base import Member
from ...ensemble import Ensemble
from ...errors import SegfuseError
from ..guards import redact
from ..worker.jobs import QueueFullError
from ..worker.thread import Worker
from .catalog import Catalog, Model
from .changes import Changes
from .fit import never_fits, sizes_of
from .places import (
    Budget,
    LoadFailedError,
    MemberFreedError,
    NoRoomError,
    Place,
    PlaceState,
    has_room,
    keep_for,
    warn_if_larger,
)

log = logging.getLogger("segfuse.server")
REAP_S = 1.0  # the reaper's longest sleep: freeing is never later than this past a keep-alive


class Pool:
    """The members a server holds, loaded on demand; see the module's docstring."""

    def __init__(
        self, catalog: Catalog, worker: Worker, load: Callable[[str], Member], budget: Budget, keep_alive_s: float
    ) -> None:
        self.catalog, self.worker, self.budget, self.keep_alive_s = catalog, worker, budget, keep_alive_s
        self._load = load
        self.ensemble = Ensemble.holding([])
        self.places = {name: Place(name, spec, pinned=catalog.pinned(name)) for name, spec in catalog.specs.items()}
        self._lock = threading.Lock()
        self._turn: asyncio.Lock | None = None  # made on the event loop, at the first load
        self.waiting = 0  # requests waiting for their turn to load
        # Models whose load waits for members in use to be let go: until it has its room, a request that would
        # pin another loaded member queues behind it (first come, first served between models), else requests
        # for a busy model would keep its members pinned and the load would wait for ever.
        self._wanting: list[Model] = []
        self.changes = Changes()  # told of every change a request waiting for members or room may wait for
        self._reaper = Reaper(self)

    # ------------------------------------------------------------------ at start and stop

    def adopt(self, members: Sequence[Member], owned: bool = False) -> None:
        """Members loaded elsewhere join, by name, kept until the server stops (the caller's: never closed)."""
        for member in members:
            place = self.places.setdefault(member.name, Place(member.name, None))
            self._joined(place, member)
            place.owned = owned

    def load_now(self, model: Model) -> None:
        """Load `model`'s members here and now, kept until a request says otherwise (preloading)."""
        for name in model.members:
            place = self.places[name]
            if place.state != "loaded":
                self._load_one(place)

    def start(self) -> None:
        self._reaper.start()

    def close(self) -> None:
        """At shutdown, once the worker stopped: close every member the pool loaded."""
        self._reaper.stop()
        for place in self.places.values():
            if place.member is not None and place.owned:
                self._close(place)

    # ------------------------------------------------------------------ leases

    @asynccontextmanager
    async def lease(self, model: Model, keep_s: float | None, deadline_s: float | None) -> AsyncIterator[Lease]:
        """`model`'s members loaded and pinned while the request queues its jobs (each holds them again:
        ``Lease.hold``); `keep_s`: the request's keep-alive (None: the default); `deadline_s`: the request's
        time from now (None: no deadline), one deadline for the loading and the jobs (``Lease.deadline``)."""
        lease = Lease(self, model, keep_s, deadline_s)
        if not self._pin_if_loaded(model.members):
            await self._bring(model, lease.deadline)
        try:
            yield lease
        finally:
            lease.release()

    def pin(self, names: Sequence[str]) -> None:
        with self._lock:
            self._pin_locked(names)

    def _pin_locked(self, names: Sequence[str]) -> None:
        for name in names:
            self.places[name].users += 1
            self.places[name].last_used = time.monotonic()

    def unpin(self, names: Sequence[str], keep_s: float | None) -> None:
        """Names let go once; a member nothing holds any more starts its keep-alive (0: freed now)."""
        now, free = time.monotonic(), []
        with self._lock:
            for name in names:
                place = self.places[name]
                place.users -= 1
                if place.users == 0:
                    place.idle_since = now
                    place.keep_s = keep_for(place, keep_s, self.catalog, self.keep_alive_s)
                    if place.keep_s == 0 and place.owned and place.state == "loaded":
                        free.append(place)
        self.changes.tell()
        for place in free:
            self.free(place)

    def expire(self, model: Model) -> None:
        """Free `model`'s members that nothing holds nor pins, now (Ollama's empty request with keep_alive 0); a
        member in use stays until its requests let it go, and then for their keep-alive (``free`` looks again)."""
        for place in [self.places[n] for n in model.members if self.places[n].freeable()]:
            self.free(place, "asked to unload")

    def _pin_if_loaded(self, names: Sequence[str]) -> bool:
        """Pin `names` if every one is loaded (in one look: none can be freed in between) and no load that
        came first waits for room they would hold (``_wanting``)."""
        with self._lock:
            if any(self.places[n].state != "loaded" for n in names):
                return False
            if any(n not in model.members for model in self._wanting for n in names):
                return False
            self._pin_locked(names)
        return True

    # ------------------------------------------------------------------ loading

    async def _bring(self, model: Model, deadline: float | None) -> None:
        """Wait for the turn to load, pin `model`'s members, make room and load what is missing."""
        if (too_large := never_fits(model, sizes_of(self.snapshot()), self.budget.nbytes)) is not None:
            raise too_large
        if self.waiting > self.worker.queue.queue_size:
            raise QueueFullError(f"{self.waiting} requests are waiting for models to load; retry in a little while")
        self._turn = self._turn or asyncio.Lock()
        self.waiting += 1
        entered = False
        try:
            async with self._turn:
                self.waiting, entered = self.waiting - 1, True
                self.pin(model.members)
                try:
                    await self._load_missing(model, deadline)
                except BaseException:
                    self.unpin(model.members, None)
                    raise
        finally:
            if not entered:
                self.waiting -= 1

    async def _load_missing(self, model: Model, deadline: float | None) -> None:
        for name in model.members:
            place = self.places[name]
            # Freed a moment ago: load it again once it is closed (on the worker thread, which says so).
            await self.changes.until(place.settled, None)
            if place.state == "loaded":
                continue
            if place.spec is None:
                raise MemberFreedError(f"member {name} was freed and cannot be loaded again")
            await self._make_room(place, model, deadline)
            try:
                await asyncio.to_thread(self._load_one, place)
            except SegfuseError as exc:
                raise LoadFailedError(
                    f"could not load member {name} of model {model.name}: {redact(str(exc))}"
                ) from None
            await self._make_room(None, model, None)  # its size is known now: free what the bytes want

    async def _make_room(self, place: Place | None, model: Model, deadline: float | None) -> None:
        """Free the least recently used idle members until `place` fits (None: until what is loaded fits);
        wait while every one is in use, up to `deadline` (None with a place: for ever; without: not at all)."""
        while True:
            with self._lock:
                if not self.budget.over(list(self.places.values()), [place] if place else []):
                    return
                idle = [p for p in self.places.values() if p.freeable()]
                victim = min(idle, key=lambda p: p.last_used, default=None)
                if victim is not None:
                    victim.state = "unloading"
            if victim is not None:
                log.info("freeing %s to make room for %s (the memory budget)", victim.name, model.name)
                await asyncio.wrap_future(self.worker.between_ticks(partial(self._close, victim)))
            elif place is None:
                log.warning("the members in use take more than the memory budget (model %s loaded)", model.name)
                return
            elif not await self._wait_for_room(place, model, deadline):
                raise NoRoomError(
                    f"model {model.name} does not fit the memory budget beside the members in use; retry later"
                )

    async def _wait_for_room(self, place: Place, model: Model, deadline: float | None) -> bool:
        """Wait until `place` could fit (False: `deadline` came first), newer requests for other loaded
        members queued behind meanwhile (``_pin_if_loaded``)."""
        with self._lock:
            self._wanting.append(model)
        try:
            return await self.changes.until(partial(self._room_for, place, model), deadline)
        finally:
            with self._lock:
                self._wanting.remove(model)

    def _room_for(self, place: Place, model: Model) -> bool:
        """Whether `place` fits now, or a member could be freed for it; NoRoomError if only pinned ones hold room."""
        with self._lock:
            return has_room(list(self.places.values()), self.budget, place, model)

    def _load_one(self, place: Place) -> None:
        """Load one member here (a loader's thread, or at start), then let it join the worker's ensemble."""
        assert place.spec is not None
        with self._lock:
            place.state, place.since, place.error = "loading", time.monotonic(), None
        log.info("loading %s (%s)", place.name, place.spec)
        try:
            member = self._load(place.spec)
        except BaseException as exc:
            with self._lock:
                place.state, place.error, place.since = "failed", str(exc), None
            self.changes.tell()
            log.error("could not load %s: %s", place.name, exc)
            raise
        member.name = place.name  # the catalog's name, whatever the backend would call it
        self._joined(place, member)
        log.info("loaded %s in %.1f s", place.name, time.monotonic() - (place.since or time.monotonic()))

    def _joined(self, place: Place, member: Member) -> None:
        with self._lock:
            place.member, place.state, place.nbytes = member, "loaded", member.nbytes
            place.loads += 1
            self.ensemble.members = [*self.ensemble.members, member]
        self.changes.tell()
        warn_if_larger(place)

    # ------------------------------------------------------------------ freeing

    def free(self, place: Place, why: str = "idle past its keep-alive") -> Future[None] | None:
        """Free an idle member (reaped, kept 0, or asked to), on the worker thread: its close (None: not freed)."""
        with self._lock:
            if place.state != "loaded" or place.users or not place.owned:
                return None
            place.state = "unloading"
        log.info("freeing %s (%s)", place.name, why)
        return self.worker.between_ticks(lambda: self._close(place))

    def _close(self, place: Place) -> None:
        """On the worker thread between steps (or at shutdown): out of the ensemble, then closed."""
        member = place.member
        with self._lock:
            self.ensemble.members = [m for m in self.ensemble.members if m is not member]
        try:
            if member is not None:
                member.close()
        except Exception:
            log.exception("closing %s failed", place.name)
        with self._lock:
            place.member, place.state, place.idle_since = None, "unloaded", None
        self.changes.tell()

    # ------------------------------------------------------------------ what it holds

    def loaded(self) -> list[Member]:
        with self._lock:
            return list(self.ensemble.members)

    def missing(self, model: Model) -> list[str]:
        """`model`'s members not loaded now (a request for it would wait for them)."""
        with self._lock:
            return [name for name in model.members if self.places[name].state != "loaded"]

    def snapshot(self) -> list[Place]:
        """Copies of every place, read together."""
        with self._lock:
            return [Place(**vars(p)) for p in self.places.values()]


class Reaper:
    """The thread that frees each idle member of a pool once its keep-alive has passed (the pool's own part:
    it reads the places under the pool's lock)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._reap, name="segfuse-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _reap(self) -> None:
        pool = self.pool
        while not self._stop.wait(self._next_wait()):
            now = time.monotonic()
            with pool._lock:
                due = [p for p in pool.places.values() if (at := p.expires_at()) is not None and at <= now]
            for place in due:
                pool.free(place)

    def _next_wait(self) -> float:
        with self.pool._lock:
            times = [at for p in self.pool.places.values() if (at := p.expires_at()) is not None]
        return max(0.0, min([REAP_S, *(at - time.monotonic() for at in times)]))


class Lease:
    """A request's hold on its model's members: one for the request itself (let go when it has queued
    its jobs), one more for each job (let go when the worker lets the job go)."""

    def __init__(self, pool: Pool, model: Model, keep_s: float | None, deadline_s: float | None) -> None:
        self.pool, self.model, self.keep_s = pool, model, keep_s
        # When the request arrived, and its deadline (time.monotonic(); None: none): read once, for the wait
        # to load its members and for its jobs (their deadline counts from the same moment).
        self.arrived = time.monotonic()
        self.deadline = None if deadline_s is None else self.arrived + deadline_s
        self._released = False

    @property
    def members(self) -> list[str] | None:
        """Who answers, as the job's request names them: None for the one ensemble a server serves (its
        Hedge weights may carry over), else the model's members in order."""
        whole = self.model.ensemble and self.pool.catalog.single()
        return None if whole else list(self.model.members)

    def hold(self) -> Callable[[], None]:
        """Hold the members once more; returns what lets them go (once, however often it is called)."""
        self.pool.pin(self.model.members)
        once = threading.Lock()

        def release() -> None:
            if once.acquire(blocking=False):
                self.pool.unpin(self.model.members, self.keep_s)

        return release

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.pool.unpin(self.model.members, self.keep_s)


__all__ = [
    "Budget",
    "Lease",
    "LoadFailedError",
    "MemberFreedError",
    "NoRoomError",
    "Place",
    "PlaceState",
    "Pool",
]
