"""A Ray member's copies as its caller sees them: which are up, how loaded, and which a new session goes to.

Every reply from a copy says how many sessions it holds (its load). A call that finds a copy
gone (its process died, its node left, Ray is restarting it) marks it down; a down copy is asked
who it is again (``info``, never waited for) each time the caller looks for a copy, and is up
again once it answers: Ray restarted it (``max_restarts``), with none of its old sessions.

A new session goes to the copy that read the longest prefix of its prompt last (``affinity.py``)
while that copy has a free slot, else to the least loaded copy.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from .affinity import Affinity
from .wire import CopyLost, Done, Held, HostInfo

log = logging.getLogger("segfuse.backends.ray")


@dataclass(eq=False)
class Copy:
    """One copy (a Ray actor running the member) and what its caller knows of it."""

    index: int
    handle: Any  # ray.actor.ActorHandle
    info: HostInfo
    up: bool = True
    load: int = 0  # sessions open on it, as its last reply said
    held: Held | None = None  # what it held when last asked (occupancy, stats)
    probe: Any = field(default=None, repr=False)  # an info() call in flight while it is down

    @property
    def full(self) -> bool:
        return self.info.slots is not None and self.load >= self.info.slots


class Copies:
    """The copies of one member and the choice of a copy for a new session."""

    def __init__(self, handles: Sequence[Any], infos: Sequence[HostInfo], *, name: str, timeout: float) -> None:
        self.all = [Copy(i, h, info) for i, (h, info) in enumerate(zip(handles, infos))]
        self.name, self.timeout = name, timeout
        self.affinity = Affinity()
        self._turn = itertools.count()  # breaks ties between equally loaded copies in turn

    def up(self) -> list[Copy]:
        return [c for c in self.all if c.up]

    def get(self, copy: Copy, ref: Any) -> Any:
        """The value of `copy`'s reply `ref` (a Done's only value), its load noted; the value is raised
        where it is an exception; a copy that is gone raises CopyLost and is marked down."""
        done = self.wait(copy, ref)
        value = done.values[0]
        if isinstance(value, BaseException):
            raise value
        return value

    def wait(self, copy: Copy, ref: Any) -> Done:
        try:
            done = ray.get(ref, timeout=self.timeout)
        except (RayActorError, GetTimeoutError) as exc:
            raise self.lost(copy, exc) from exc
        copy.load = done.load
        return cast(Done, done)

    def lost(self, copy: Copy, why: BaseException) -> CopyLost:
        """Mark `copy` down; the error a call that met it raises."""
        if copy.up:
            log.warning(
                "%s: copy %d on %s is gone: %s",
                self.name,
                copy.index,
                copy.info.node_ip,
                str(why).splitlines()[0] if str(why) else type(why).__name__,
            )
        copy.up, copy.probe = False, None
        return CopyLost(
            f"{self.name}: copy {copy.index} on {copy.info.node_ip} is gone ({type(why).__name__})",
            "its sessions are read again on another copy",
        )

    def revive(self) -> None:
        """Ask each down copy who it is, without waiting; one that answered is up again."""
        for copy in self.all:
            if copy.up:
                continue
            if copy.probe is None:
                copy.probe = copy.handle.info.remote()
                continue
            ready, _ = ray.wait([copy.probe], timeout=0)
            if not ready:
                continue
            probe, copy.probe = copy.probe, None
            try:
                info = ray.get(probe)
            except RayActorError:
                continue  # still restarting (asked again next time), or dead for good
            if isinstance(info, HostInfo):
                copy.info, copy.up, copy.load = info, True, 0
                log.warning("%s: copy %d is back on %s", self.name, copy.index, info.node_ip)

    def choose(self, keys: Sequence[bytes], exclude: Sequence[Copy] = ()) -> list[Copy]:
        """The up copies to try for a new session whose prompt has prefix `keys`, best first: the copy
        that read its longest known prefix while it has a free slot, then the least loaded."""
        self.revive()
        candidates = [c for c in self.up() if c not in exclude]
        turn = next(self._turn)
        ordered = sorted(candidates, key=lambda c: (c.full, c.load, (c.index - turn) % len(self.all)))
        found = self.affinity.find(keys)
        near = next((c for c in ordered if c.index == found and not c.full), None)
        return ([near] if near else []) + [c for c in ordered if c is not near]
