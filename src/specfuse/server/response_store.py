"""The responses a later request may continue (``previous_response_id``): a bounded store in memory.

It keeps each stored response's conversation as chat messages (the input and the answer, without the
instructions), the newest ``capacity`` of them; older ones are forgotten, and a request that names one
gets a clear 400. Nothing survives a restart: a client that needs longer memory sends the whole input.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

CAPACITY = 512  # responses kept; each is bounded by [limits] (messages and characters) when it was made


class ResponseStore:
    """Conversations by response id, the least recently used forgotten first."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()  # parsing runs in threads beside the event loop

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response_id] = messages
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            messages = self._items.get(response_id)
            if messages is not None:
                self._items.move_to_end(response_id)
            return messages

    def __len__(self) -> int:
        return len(self._items)


__all__ = ["CAPACITY", "ResponseStore"]
