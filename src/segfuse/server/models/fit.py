"""Whether a model can ever fit the memory budget (``[server] max_loaded_bytes``), told from its members'
sizes before any of them loads: estimated from their files (``backends/registry.estimate_bytes``), or
measured once a member has loaded. A model that never can is refused at start, or at the request that
names it, with what it needs and what to do, rather than loading past the budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from ...errors import SegfuseError
from .catalog import Catalog, Model

HINT = (
    "raise [server] max_loaded_bytes (--max-loaded-bytes) to at least {need}, or make the members smaller: a "
    "lower [members] n_ctx, max_concurrent or prefix_cache_cells (the KV cache), or a smaller quantisation"
)


class TooLargeError(SegfuseError):
    """A model (one member, or its members together) needs more bytes than the memory budget allows."""


class ModelInUseError(SegfuseError):
    """A model asked to unload is still answering when the wait for it ends."""


@dataclass(frozen=True)
class Size:
    """A member's bytes, and whether they were measured (loaded once) or estimated from its file."""

    nbytes: int
    measured: bool = False

    def __str__(self) -> str:
        return f"{mib(self.nbytes)} ({'measured' if self.measured else 'estimated'})"


class Sized(Protocol):
    """A member's place in the pool, as far as its size goes."""

    name: str
    nbytes: int | None  # measured, once loaded

    def size(self) -> int: ...  # measured, else estimated (0: unknown)


def sizes_of(places: Iterable[Sized]) -> dict[str, Size]:
    """Each member's bytes where they are known: measured, else estimated."""
    return {p.name: Size(p.size(), p.nbytes is not None) for p in places if p.size()}


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


def never_fits(model: Model, sizes: Mapping[str, Size], bound: int | None) -> TooLargeError | None:
    """Why `model` can never be loaded within `bound` bytes (None: it can, its sizes are unknown, or no bound)."""
    if bound is None:
        return None
    for name in model.members:
        size = sizes.get(name)
        if size is not None and size.nbytes > bound:
            return TooLargeError(
                f"member {name} of model {model.name} needs {size}, more than max_loaded_bytes {mib(bound)}",
                HINT.format(need=mib(size.nbytes)),
            )
    members = dict.fromkeys(model.members)  # a member named twice is two copies, but loaded once here
    total = sum(sizes[n].nbytes for n in members if n in sizes)
    if total > bound:
        parts = ", ".join(f"{n} {sizes[n]}" for n in members if n in sizes)
        return TooLargeError(
            f"model {model.name} needs {mib(total)} for its members together ({parts}), more than "
            f"max_loaded_bytes {mib(bound)}",
            HINT.format(need=mib(total)),
        )
    return None


def check_all(catalog: Catalog, sizes: Mapping[str, Size], bound: int | None) -> None:
    """At start: every model the server serves fits `bound` (None: no bound), and so do the pinned members
    together (they are never freed); else TooLargeError for the first that does not."""
    if bound is None:
        return
    for model in catalog.models.values():
        if (error := never_fits(model, sizes, bound)) is not None:
            raise error
    pinned = [name for name in catalog.specs if catalog.pinned(name) and name in sizes]
    total = sum(sizes[name].nbytes for name in pinned)
    if total > bound:
        raise TooLargeError(
            f"the pinned ensembles' members ({', '.join(pinned)}) need {mib(total)} together, more than "
            f"max_loaded_bytes {mib(bound)}: they are never freed, so they could not all be loaded",
            "pin fewer ensembles (keep_alive -1), or " + HINT.format(need=mib(total)),
        )


__all__ = ["ModelInUseError", "Size", "Sized", "TooLargeError", "check_all", "mib", "never_fits", "sizes_of"]
