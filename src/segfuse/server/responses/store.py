"""The responses a later request may continue (``previous_response_id``): a bounded store in memory.

It keeps each stored response's conversation as chat messages (the input and the answer, without the
instructions): the newest ``capacity`` of them, within ``max_chars`` characters of text in all; older
ones are forgotten, and a request that names one gets a clear 400. Nothing survives a restart: a client
that needs longer memory sends the whole input.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

CAPACITY = 512  # responses kept
MAX_CHARS = 32_000_000  # characters of text kept in all (a conversation is also bounded by [limits] when made)


def size(messages: list[dict[str, Any]]) -> int:
    """Characters of text in a conversation: contents and tool calls' arguments."""
    total = 0
    for m in messages:
        total += len(m.get("content") or "")
        total += sum(len(c["function"]["arguments"]) + len(c["function"]["name"]) for c in m.get("tool_calls") or [])
    return total


class ResponseStore:
    """Conversations by response id, the least recently used forgotten first."""

    def __init__(self, capacity: int = CAPACITY, max_chars: int = MAX_CHARS) -> None:
        self.capacity, self.max_chars = capacity, max_chars
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # parsing runs in threads beside the event loop

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        chars = size(messages)
        if chars > self.max_chars:
            return  # larger than the whole store: not kept (a later request naming it gets the 400)
        with self._lock:
            if (old := self._items.pop(response_id, None)) is not None:
                self._chars -= old[1]
            self._items[response_id] = (messages, chars)
            self._chars += chars
            while len(self._items) > self.capacity or self._chars > self.max_chars:
                _, (_, dropped) = self._items.popitem(last=False)
                self._chars -= dropped

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            entry = self._items.get(response_id)
            if entry is None:
                return None
            self._items.move_to_end(response_id)
            return entry[0]

    def __len__(self) -> int:
        return len(self._items)

    @property
    def chars(self) -> int:
        return self._chars


__all__ = ["CAPACITY", "MAX_CHARS", "ResponseStore", "size"]
