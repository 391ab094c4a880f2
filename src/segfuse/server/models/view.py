"""What the server says of its models: the cards of ``/v1/models`` and ``/health``'s ``memory``.

Read from the pool: its catalog (the models served) and where each member stands; the routes that show
them are in ``app.py``.
"""

from __future__ import annotations

import time
from typing import Any

from ..guards import redact
from ..wire import MemberLoad, ModelCard, ModelMemory, ModelState
from .catalog import Model
from .pool import PlaceState, Pool


def model_cards(pool: Pool, created: int) -> list[ModelCard]:
    """Every ensemble, then each member (a member alone is a model of its own: a baseline); each with the
    context it takes (an ensemble: its smallest member's) and whether it is loaded; `created`: when the
    server started (Unix seconds)."""
    catalog, members = pool.catalog, pool.loaded()
    loaded = {m.name for m in members}
    contexts = {m.name: getattr(m, "n_ctx", None) for m in members}

    def card(model: str, **more: Any) -> ModelCard:
        window = context_length(pool, model, contexts)
        return ModelCard(id=model, created=created, context_length=window, max_model_len=window, **more)

    ensembles = [
        card(m.name, members=list(m.members), loaded=loaded.issuperset(m.members))
        for m in catalog.models.values()
        if m.ensemble
    ]
    alone = [
        card(
            name, parent=next(iter(catalog.holders(name)), None), ensembles=catalog.holders(name), loaded=name in loaded
        )
        for name in pool.places
    ]
    return ensembles + alone


def context_length(pool: Pool, model: str, contexts: dict[str, int | None]) -> int | None:
    """The prompt and answer a model takes, in tokens: a member's window, or for an ensemble the
    smallest of its members' (every member reads the whole conversation); None until all are loaded.
    `contexts`: each loaded member's window for one session."""
    chosen = pool.catalog.models.get(model)
    windows = [contexts.get(name) for name in chosen.members] if chosen is not None else [contexts.get(model)]
    return None if None in windows or not windows else min(w for w in windows if w is not None)


def memory_of(pool: Pool, detailed: bool = False) -> dict[str, MemberLoad]:
    """Each member's place in memory, as /health shows it; a failed load's error without its paths and URLs
    unless `detailed` (the request holds the key), as every text from inside."""
    now = time.monotonic()
    return {
        place.name: MemberLoad(
            state=place.state,
            ensembles=pool.catalog.holders(place.name),
            in_use=place.users,
            bytes=place.nbytes,
            estimated_bytes=place.estimate,
            pinned=place.pinned,
            loading_s=None if place.state != "loading" or place.since is None else round(now - place.since, 1),
            expires_in_s=None if (at := place.expires_at()) is None else round(max(0.0, at - now), 1),
            error=place.error if place.error is None or detailed else redact(place.error),
            loads=place.loads,
        )
        for place in pool.snapshot()
    }


def model_state(pool: Pool, model: Model) -> ModelState:
    """Where `model` stands in memory, from its members' places."""
    memory = memory_of(pool)
    members = {name: memory[name] for name in dict.fromkeys(model.members)}
    states = {m.state for m in members.values()}
    in_use = max(m.in_use for m in members.values())
    expiring = [m.expires_in_s for m in members.values() if m.expires_in_s is not None]
    return ModelState(
        id=model.name,
        state=_overall(states, in_use),
        in_use=in_use,
        pinned=all(m.pinned for m in members.values()),
        expires_in_s=min(expiring, default=None),
        members=members,
    )


def _overall(states: set[PlaceState], in_use: int) -> ModelMemory:
    """One word for a model's members' states: the most telling of them."""
    for word in ("failed", "loading", "unloading"):
        if word in states:
            return word
    if states == {"loaded"}:
        return "loaded" if in_use else "idle"
    return "partly loaded" if "loaded" in states else "unloaded"


__all__ = ["context_length", "memory_of", "model_cards", "model_state"]
