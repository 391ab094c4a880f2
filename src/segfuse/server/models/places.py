"""A member's place in the server's pool and the rules of room (``pool.py`` keeps the places and their lock):
what a place holds, the memory budget, how long a member stays once let go, whether a model fits, and the
pool's domain errors (MemberFreedError, LoadFailedError, NoRoomError), which the server's edge
(``serving.api_error``) gives their HTTP status."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ...backends.base import Member
from ...errors import SegfuseError
from ...keep_alive import FOREVER
from .catalog import Catalog, Model
from .fit import mib

log = logging.getLogger("segfuse.server")

PlaceState = Literal["unloaded", "loading", "loaded", "unloading", "failed"]


class MemberFreedError(SegfuseError):
    """A member given loaded (no spec to load it from) was freed: it cannot be loaded again."""


class LoadFailedError(SegfuseError):
    """A member of the model a request names could not be loaded (the fault's text redacted as it is written)."""


class NoRoomError(SegfuseError):
    """A model does not fit the memory budget beside the members in use, and the request's deadline came."""


@dataclass
class Place:
    """One member's place in the pool."""

    name: str
    spec: str | None  # what loads it (None: a member given loaded, that cannot be loaded again)
    member: Member | None = None
    state: PlaceState = "unloaded"
    users: int = 0  # requests and jobs holding it: never freed while any do
    keep_s: float = FOREVER  # how long it stays after its last user lets it go
    idle_since: float | None = None  # time.monotonic() when its last user let it go
    last_used: float = 0.0  # time.monotonic() of its last lease (the least recently used goes first)
    owned: bool = True  # False: the caller's members, never freed nor closed here
    nbytes: int | None = None  # its bytes where it runs, once loaded (kept to make room before a reload)
    estimate: int | None = None  # its bytes as its file says, before it loads (None: cannot be told)
    pinned: bool = False  # an ensemble pins it (keep_alive -1): never freed by expiry nor to make room
    error: str | None = None  # why its last load failed
    loads: int = 0  # times it was loaded (a member two models share: once, while it stays)
    since: float | None = None  # time.monotonic() when its load began

    def settled(self) -> bool:
        """Not on its way out (an unload's close still to come, on the worker thread)."""
        return self.state != "unloading"

    def freeable(self) -> bool:
        """Loaded, the pool's own, held by no one and not pinned: it may be freed to make room."""
        return self.state == "loaded" and not self.users and self.owned and not self.pinned

    def size(self) -> int:
        """The bytes the budget counts for it: measured once loaded, else estimated (0: unknown)."""
        return self.nbytes if self.nbytes is not None else self.estimate or 0

    def expires_at(self) -> float | None:
        """When the reaper frees it (None: in use, kept, pinned, or not loaded)."""
        if self.state != "loaded" or self.users or not self.owned or self.idle_since is None or self.pinned:
            return None
        return None if self.keep_s == FOREVER else self.idle_since + self.keep_s


@dataclass(frozen=True)
class Budget:
    """What may be loaded at once: members, bytes of weights (None: no bound)."""

    members: int | None = None
    nbytes: int | None = None

    def over(self, places: Sequence[Place], adding: Sequence[Place] = ()) -> bool:
        held = [p for p in places if p.state in ("loaded", "loading", "unloading")] + list(adding)
        if self.members is not None and len(held) > self.members:
            return True
        # A member not loaded yet counts what its file says it will take: the first load cannot pass the bound.
        return self.nbytes is not None and sum(p.size() for p in held) > self.nbytes


def keep_for(place: Place, keep_s: float | None, catalog: Catalog, default_s: float) -> float:
    """How long `place` stays once let go: kept when pinned; else the request's keep-alive (`keep_s`), its
    ensembles' ([ensembles.NAME] keep_alive), kept for a member of a preloaded model, `default_s` for others."""
    if place.pinned:
        return FOREVER
    if keep_s is not None:
        return keep_s
    if (ensembles := catalog.keep_of(place.name)) is not None:
        return ensembles
    preloaded = any(model in catalog.preload for model in catalog.holders(place.name))
    return FOREVER if preloaded else default_s


def has_room(places: Sequence[Place], budget: Budget, place: Place, model: Model) -> bool:
    """Whether `place` fits beside `places` now, or one of them could be freed for it (nothing else to wait
    for); NoRoomError when only members that stay (pinned) hold the room: no wait would find it."""
    if not budget.over(places, [place]) or any(p.freeable() for p in places):
        return True
    if (stuck := held_for_good(places, model)) is not None:
        raise stuck
    return False


def warn_if_larger(place: Place) -> None:
    """A member measured larger than its estimate: the budget counts the measure from now on (and says so)."""
    if place.estimate is not None and place.nbytes is not None and place.nbytes > place.estimate:
        log.warning("%s takes %s, more than the %s estimated", place.name, mib(place.nbytes), mib(place.estimate))


def held_for_good(places: Sequence[Place], model: Model) -> NoRoomError | None:
    """The error for `model` when every member holding room beside its own stays (pinned, or the caller's):
    then no wait can find it room (None: something may yet be let go)."""
    held = [p for p in places if p.state in ("loaded", "loading", "unloading") and p.name not in model.members]
    if not held or not all(p.pinned or not p.owned for p in held):
        return None
    return NoRoomError(
        f"model {model.name} does not fit the memory budget beside {', '.join(p.name for p in held)}, which stay "
        "loaded (pinned)",
        "free them (POST /v1/models/{id}/unload), or raise max_loaded_bytes",
    )
