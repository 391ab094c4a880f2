"""What the front ends of one server share, behind one small interface: the Responses store, the metrics
/metrics reports, and the view of members that run in copies.

A server in one process keeps them in memory (:class:`Shared` over the store of ``responses/store.py``,
which the app gives it; the app's own metrics; its members' own view of their copies). Front ends in several processes (``segfuse serve
--ray``: Ray Serve replicas) share one Ray actor and the deployment that owns the copies instead
(``server/ray/state.py``), so that any replica answers as the one before it would have. The Hedge weights
(``hedge_persist``) are the served ensemble's, in its ``hedge_store`` (``hedge_store.py``): ``hedge_of``
decides whether it carries them over and in which store (``Shared.weights``), for every way a server is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..config import ServerConfig
from ..ensemble import Ensemble
from ..hedge_store import MemoryWeights, WeightStore
from .copies import CopiesView, local_view
from .metrics import ServerMetrics, WorkerView


class Responses(Protocol):
    """Conversations by response id (``previous_response_id``): ``responses/store.py``'s interface."""

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None: ...

    def get(self, response_id: str) -> list[dict[str, Any]] | None: ...


class Shared:
    """One process serving alone: everything in memory."""

    replica: str | None = None  # the front-end replica's name, where there are several

    def __init__(self, responses: Responses) -> None:
        self.responses = responses
        self.weights: WeightStore = MemoryWeights()  # the Hedge weights a served ensemble carries over

    def metrics(self, worker: WorkerView) -> ServerMetrics:
        """The app's metrics over its worker."""
        return ServerMetrics(worker)

    async def copies(self, members: Sequence[Any]) -> CopiesView:
        """The copies of `members` that run in copies, as last read (no call to any copy)."""
        return local_view(members)


def hedge_of(
    config: ServerConfig, shared: Shared | None = None, given: Ensemble | None = None
) -> tuple[bool, WeightStore]:
    """Whether a served ensemble carries its Hedge weights from one query to the next, and in which store:
    the one place the server decides it. An ensemble the caller gives keeps its own (an embedder's; a Ray
    front end's, made with this function). Else ``[server] hedge_persist``, for a server of one ensemble
    (the weights are one ensemble's: config.py refuses hedge_persist with several), in the store the front
    ends share (`shared`'s weights: memory in one process, the shared actor on Ray; None: memory)."""
    if given is not None:
        return given.hedge_persist, given.hedge_store
    persist = config.server.hedge_persist and len(config.declared()) == 1
    return persist, shared.weights if shared is not None else MemoryWeights()


__all__ = ["Responses", "Shared", "hedge_of"]
