"""What the server says of its models: the cards of ``/v1/models`` and ``/health``'s ``memory``.

Read from the catalog (the models served) and the pool (where each member stands); the routes that show
them are in ``app.py``.
"""

from __future__ import annotations

import time
from typing import Any

from .state import ServerState
from .wire import MemberLoad, ModelCard


def model_cards(state: ServerState) -> list[ModelCard]:
    """Every ensemble, then each member (a member alone is a model of its own: a baseline); each with the
    context it takes (an ensemble: its smallest member's) and whether it is loaded."""
    catalog, loaded = state.catalog, {m.name for m in state.loaded}

    def card(model: str, **more: Any) -> ModelCard:
        window = state.context_length(model)
        return ModelCard(id=model, created=state.started, context_length=window, max_model_len=window, **more)

    ensembles = [
        card(m.name, members=list(m.members), loaded=loaded.issuperset(m.members))
        for m in catalog.models.values()
        if m.ensemble
    ]
    members = [
        card(
            name, parent=next(iter(catalog.holders(name)), None), ensembles=catalog.holders(name), loaded=name in loaded
        )
        for name in state.members
    ]
    return ensembles + members


def memory_of(state: ServerState) -> dict[str, MemberLoad]:
    """Each member's place in memory, as /health shows it."""
    now = time.monotonic()
    return {
        place.name: MemberLoad(
            state=place.state,
            ensembles=state.catalog.holders(place.name),
            in_use=place.users,
            bytes=place.nbytes,
            loading_s=None if place.state != "loading" or place.since is None else round(now - place.since, 1),
            expires_in_s=None if (at := place.expires_at()) is None else round(max(0.0, at - now), 1),
            error=place.error,
            loads=place.loads,
        )
        for place in state.pool.snapshot()
    }


__all__ = ["memory_of", "model_cards"]
