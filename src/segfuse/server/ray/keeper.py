"""The deployment that owns the members' copies and the shared state (``Members`` in the application).

On its start it starts every planned member's copies (``create_hosts``: Ray actors placed by the
resources they ask for, spread over the nodes) and the shared state actor (``state.py``), and waits
until each copy has loaded its member. The front-end replicas ask it for them (:meth:`Keeper.setup`),
so that every replica uses the same copies; none loads its own. The copies and the shared state are
owned by the keeper's process: when the application stops, or that process dies, Ray stops them too
(Serve then starts a new keeper, which starts new copies; the front ends that held the old ones fail
their health check and are replaced, so that they ask the new one).

:meth:`Keeper.view` says where each copy runs, its load and prefix-cache hits, and what is degraded: a
copy down (Ray restarts it, ``restarts=``), a node gone (its copies restarting elsewhere), fewer
front-end replicas running than asked for. It asks each copy (``RayMember.refresh``), at most every
:data:`FRESH_S`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from ...backends.ray.host import create_hosts
from ...backends.ray.member import RayMember
from ...backends.ray.settings import RaySettings
from ...config import ServerConfig
from ..copies import CopiesView, down_copies, rows_of
from .plan import copy_options, plan
from .state import shared_actor_class

log = logging.getLogger("segfuse.server")
KEEPER, FRONT = "Members", "Front"  # the application's deployments
FRESH_S = 0.5  # a view this recent is answered again
ASK_TIMEOUT_S = 5.0  # a copy that does not say what it holds within this long counts as down


@dataclass(frozen=True)
class Setup:
    """What a front-end replica needs: the shared state, and each member's copies (None: a remote member,
    which the replica loads itself) with their settings."""

    keeper: str  # this keeper's id: a front end whose keeper changed must be replaced
    state: Any
    members: list[tuple[str, list[Any] | None, RaySettings]]


class Keeper:
    """The copies' owner (module docstring)."""

    async def __init__(self, config: dict[str, Any]) -> None:  # type: ignore[misc]  # Serve awaits it
        self.config = ServerConfig.model_validate(config)
        self.id = uuid.uuid4().hex
        self.planned = plan(self.config)
        self.state = shared_actor_class().remote()
        self.members: list[RayMember | None] = []
        await asyncio.to_thread(self._start)
        self._lock = threading.Lock()
        self._seen: tuple[float, CopiesView] | None = None
        log.info("members ready: %s", "; ".join(m.placement for m in self.members if m is not None))

    def _start(self) -> None:
        """Start every member's copies at once, then wait for each (a load error is the member's own)."""
        shared = copy_options(self.config)
        hosts = [None if p.inner is None else create_hosts(p.inner, shared, p.settings) for p in self.planned]
        try:
            for p, handles in zip(self.planned, hosts):
                self.members.append(None if handles is None else RayMember(handles, p.settings, owned=True))
        except BaseException:
            for handles in hosts:
                for handle in handles or []:
                    ray.kill(handle, no_restart=True)
            raise
        for member in self.members:
            if member is not None:  # the keeper only asks what they hold: a copy that does not say is down
                member.copies.timeout = ASK_TIMEOUT_S

    def ident(self) -> str:
        """This keeper's id (new each time Serve starts one)."""
        return self.id

    def setup(self) -> Setup:
        members = [
            (p.spec, None if m is None else list(m.hosts), p.settings) for p, m in zip(self.planned, self.members)
        ]
        return Setup(self.id, self.state, members)

    async def view(self) -> CopiesView:
        return await asyncio.to_thread(self._view)

    def _view(self) -> CopiesView:
        with self._lock:
            if self._seen is None or time.monotonic() - self._seen[0] > FRESH_S:
                self._seen = (time.monotonic(), self._read())
            return self._seen[1]

    def _read(self) -> CopiesView:
        nodes = ray.nodes()  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
        gone = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes if not n["Alive"]}
        found: dict[str, list[dict[str, Any]]] = {}
        degraded: list[str] = []
        for member in self.members:
            if member is None:
                continue
            member.refresh()
            rows = found[member.name] = rows_of(member) or []
            degraded += down_copies(member.name, rows)
            degraded += [
                f"node {gone[row['node_id']]} left: {member.name} copy {row['index']} restarts on another "
                "node where one has room"
                for row in rows
                if row["node_id"] in gone
            ]
        return CopiesView(found, degraded + self._fronts())

    def _fronts(self) -> list[str]:
        """Fewer front-end replicas running than asked for, in words (none where Serve cannot say)."""
        try:
            app = serve.status().applications.get(self.config.ray.app_name)
            front = app.deployments.get(FRONT) if app is not None else None
        except Exception:  # a view for operators: Serve's own status is best effort
            return []
        if front is None:
            return []
        running = sum(n for state, n in front.replica_states.items() if state == "RUNNING")
        want = self.config.ray.replicas
        return [] if running >= want else [f"front end: {running} of {want} replicas running (Serve starts the others)"]

    def __del__(self) -> None:
        for member in self.members:
            if member is not None:
                member.close()
        try:
            ray.kill(self.state, no_restart=True)
        except Exception:  # already gone, or Ray is shutting down
            pass


__all__ = ["FRONT", "KEEPER", "Keeper", "Setup"]
