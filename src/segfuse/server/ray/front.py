"""A front-end replica (``Front`` in the application): the server's own app over the keeper's copies.

The app is `segfuse serve`'s (``server/app.py``: every route, limit and stream as in one process),
made over an ensemble of Ray members on the copies the keeper started (``keeper.py``; a remote
member is loaded here), with what the replicas share in the shared actor (``state.py``). Each response
names the replica that answered in :data:`REPLICA_HEADER`. Serve asks the replica's health every
few seconds: a worker that cannot go on, or a keeper that was replaced (its copies with it), fails
it, and Serve starts a new replica in its place.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.exceptions import TaskCancelledError
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as AsgiMessage

from ...backends.ray.member import RayMember
from ...config import ServerConfig
from ...ensemble import Ensemble
from ..app import create_app
from ..shared import hedge_of
from .keeper import Setup
from .plan import remote_options
from .state import RayShared

REPLICA_HEADER = "x-segfuse-replica"


class ReplicaHeader:
    """ASGI middleware: every response says which replica answered, and a client gone is a disconnect.

    When a client goes away, Serve's proxy cancels the request, and the replica's ``receive`` raises
    Ray's TaskCancelledError where ASGI says ``{"type": "http.disconnect"}``; the app's streams listen for
    the latter (they end the answer as cancelled), so it is translated here rather than logged as an error.
    """

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: AsgiMessage) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)]
            await send(message)

        async def listened() -> AsgiMessage:
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        await self.app(scope, listened, named)


@serve.ingress()
class Front:
    """One front-end replica (module docstring)."""

    async def __init__(self, config: dict[str, Any], keeper: Any) -> None:  # type: ignore[misc]  # Serve awaits it
        self.config = ServerConfig.model_validate(config)
        self.keeper = keeper
        self.setup: Setup = await keeper.setup.remote()
        self.replica: str = serve.get_replica_context().replica_id.unique_id
        self.shared = RayShared(self.setup.state, keeper, self.replica)
        self.ensemble = await asyncio.to_thread(self._ensemble)
        self.asgi: FastAPI | None = None

    def _ensemble(self) -> Ensemble:
        """The keeper's copies as Ray members (they stay the keeper's), and the remote members loaded here."""
        members = [
            spec if hosts is None else RayMember(hosts, settings) for spec, hosts, settings in self.setup.members
        ]
        persist, store = hedge_of(self.config, self.shared)  # the weights in the shared actor, for every replica
        return Ensemble(members, hedge_persist=persist, hedge_store=store, **remote_options(self.config))

    def __serve_build_asgi_app__(self) -> FastAPI:
        self.asgi = create_app(self.config, self.ensemble, self.shared)
        self.asgi.add_middleware(ReplicaHeader, replica=self.replica)
        return self.asgi

    async def check_health(self) -> None:
        """Raise where this replica cannot serve (Serve replaces it)."""
        fatal = self.asgi.state.segfuse.worker.fatal if self.asgi is not None else None
        if fatal is not None:
            raise RuntimeError(f"the worker stopped: {fatal}")
        keeper = await self.keeper.ident.remote()
        if keeper != self.setup.keeper:
            raise RuntimeError("the members' keeper was replaced, and its copies with it")

    def __del__(self) -> None:
        self.shared.close()
        self.ensemble.close()


__all__ = ["REPLICA_HEADER", "Front", "ReplicaHeader"]
