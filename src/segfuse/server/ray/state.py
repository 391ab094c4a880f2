"""What every front-end replica shares, in one Ray actor, and each replica's side of it.

:class:`SharedState` (the actor, started and owned by the keeper: it stops with the application)
holds the Responses store (the same bounded store a server in one process keeps:
``responses/store.py``), the Hedge weights (``hedge_persist``) and each replica's last metrics.
A replica reaches it through :class:`RayShared`, the server's ``Shared`` interface (``server/shared.py``):
every call waits for the actor's reply, so that what one replica stored is there for the next request,
whichever replica takes it. A call costs a round trip to the actor (0.55-0.77 ms on one machine,
docs/deploy.md): a stored response once per Responses request, the weights twice per request with Hedge
on, the metrics once a second and per scrape.

Where the actor cannot be reached (its process died: Ray restarts it, empty) the server goes on: a
response is not stored (a request naming it gets the usual 400), the weights start afresh, and
the error is logged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
from prometheus_client import generate_latest
from ray.exceptions import GetTimeoutError, RayError

from ..copies import CopiesView, copy_families
from ..metrics import Families, ServerMetrics, WorkerView
from ..responses.store import ResponseStore
from ..shared import Shared
from .board import PUBLISH_S, Family, merge, plain

log = logging.getLogger("segfuse.server")
CALL_TIMEOUT_S = 10.0  # a reply of the shared actor; longer counts as unreachable
VIEW_TIMEOUT_S = 10.0  # the keeper's view of the copies


class SharedState:
    """The shared actor (module docstring)."""

    def __init__(self) -> None:
        self.responses = ResponseStore()
        self.weights: dict[str, float] = {}
        self.board: dict[str, tuple[float, list[Family]]] = {}

    def put_response(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self.responses.put(response_id, messages)

    def get_response(self, response_id: str) -> list[dict[str, Any]] | None:
        return self.responses.get(response_id)

    def get_weights(self) -> dict[str, float]:
        return self.weights

    def put_weights(self, weights: dict[str, float]) -> None:
        self.weights = dict(weights)

    def publish(self, replica: str, families: list[Family]) -> None:
        self.board[replica] = (time.monotonic(), families)

    def figures(self, exclude: str) -> list[tuple[float, list[Family]]]:
        """Every other replica's last figures, with their age in seconds."""
        now = time.monotonic()
        return [(now - at, families) for replica, (at, families) in self.board.items() if replica != exclude]


HEAD = "node:__internal_head__"  # the resource only the head node has


@functools.cache
def shared_actor_class() -> Any:
    # One call at a time: nothing in it waits. On the head node, which a cluster cannot lose; restarted
    # where its process dies (empty).
    return ray.remote(num_cpus=0, max_restarts=-1, resources={HEAD: 0.001})(SharedState)


def _call(method: Any, *args: Any, default: Any = None, quiet: bool = False) -> Any:
    """`method.remote(*args)`'s value; `default` where the actor cannot answer (logged unless `quiet`)."""
    try:
        return ray.get(method.remote(*args), timeout=CALL_TIMEOUT_S)
    except (RayError, GetTimeoutError) as exc:
        if not quiet:
            log.error("the shared state did not answer %s: %s", method._method_name, str(exc).splitlines()[0])
        return default


class RayResponses:
    """The Responses store, in the shared actor."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        _call(self.actor.put_response, response_id, messages)

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        found: list[dict[str, Any]] | None = _call(self.actor.get_response, response_id)
        return found


class RayWeights:
    """The Hedge weights, in the shared actor (an ensemble's ``hedge_store``)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def get(self) -> dict[str, float]:
        weights: dict[str, float] = _call(self.actor.get_weights, default={})
        return weights

    def put(self, weights: dict[str, float]) -> None:
        _call(self.actor.put_weights, weights)


class ClusterMetrics(ServerMetrics):
    """One replica's metrics, published to the shared actor and rendered as every replica's total."""

    def __init__(self, worker: WorkerView, actor: Any, replica: str) -> None:
        super().__init__(worker)
        self.actor, self.replica = actor, replica
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._publishing, name="segfuse-metrics", daemon=True)
        self._thread.start()

    def _own(self) -> list[Family]:
        return plain(self.registry.collect())

    def publish(self, quiet: bool = False) -> list[Family]:
        own = self._own()
        _call(self.actor.publish, self.replica, own, quiet=quiet)
        return own

    def _publishing(self) -> None:
        # Quiet: a scrape says when the actor is unreachable; this would say it every second.
        while not self._stop.wait(PUBLISH_S):
            self.publish(quiet=True)

    def render(self, private: bool = True, copies: CopiesView | None = None) -> bytes:
        own = self.publish()
        others = _call(self.actor.figures, self.replica, default=[])
        families = Families(merge(own, others), copy_families(copies), private=private)
        return generate_latest(families)

    def close(self) -> None:
        """Stop publishing; the replica's last figures stay on the board, where the shared actor is still up
        (it may stop first, when the whole application does)."""
        self._stop.set()
        self._thread.join(5)
        self.publish(quiet=True)


class RayShared(Shared):
    """A front-end replica's side of what the replicas share (module docstring)."""

    def __init__(self, actor: Any, keeper: Any, replica: str) -> None:
        super().__init__(RayResponses(actor))
        self.actor, self.keeper, self.replica, self.name = actor, keeper, replica, replica
        self.weights = RayWeights(actor)
        self.figures: ClusterMetrics | None = None

    def metrics(self, worker: WorkerView) -> ServerMetrics:
        self.figures = ClusterMetrics(worker, self.actor, self.name)
        return self.figures

    async def copies(self, members: Sequence[Any]) -> CopiesView:
        """The keeper's view: every copy, the nodes and replicas gone (``keeper.py``)."""
        try:
            return await asyncio.wait_for(_await(self.keeper.view.remote()), VIEW_TIMEOUT_S)
        except Exception as exc:  # the view must never fail /health
            log.error("the members' keeper did not answer: %s", exc)
            return CopiesView(
                degraded=[
                    f"the deployment that owns the members' copies did not answer "
                    f"({type(exc).__name__}); Serve restarts it where its process died"
                ]
            )

    def close(self) -> None:
        if self.figures is not None:
            self.figures.close()


async def _await(response: Any) -> Any:
    return await response


__all__ = ["ClusterMetrics", "RayResponses", "RayShared", "RayWeights", "SharedState", "shared_actor_class"]
