"""Where an ensemble keeps the Hedge weights a query ends with, for the next (``hedge_persist``).

In memory by default (:class:`MemoryWeights`); a server whose front ends run in several processes
gives each front end's ensemble one store they all read and write (``server/ray/state.py``), so that
a query starts from the weights the last query ended with, whichever process answered it.
"""

from __future__ import annotations

import threading
from typing import Protocol


class WeightStore(Protocol):
    """The weights the last query with Hedge on ended with (empty before the first)."""

    def get(self) -> dict[str, float]: ...

    def put(self, weights: dict[str, float]) -> None: ...


class MemoryWeights:
    """Weights kept in this process."""

    def __init__(self) -> None:
        self._weights: dict[str, float] = {}
        self._lock = threading.Lock()

    def get(self) -> dict[str, float]:
        with self._lock:
            return dict(self._weights)

    def put(self, weights: dict[str, float]) -> None:
        with self._lock:
            self._weights = dict(weights)


__all__ = ["MemoryWeights", "WeightStore"]
