"""Contexts of their own for deterministic sessions (``start(..., deterministic=True)``).

llama.cpp's numbers for a token depend on more than the tokens before it: on the batch
split that read them (a prompt read after a cached prefix is read in two batches), and on
the cells of the KV cache its sequence sits in (the CPU's flash attention adds over tiles
of cells, so the same tokens placed after another request's cells add in another order;
measured: up to 0.14 nats on a draft's log-probabilities, enough to flip a near tie).
A shared cache cannot promise either. A deterministic session therefore runs in a context
of its own, emptied before it starts: its prompt is read from position 0 in ``n_batch``
chunks, its cells start at cell 0, and no other session's tokens share its decodes, so it
computes what a lone request on a fresh member computes, whatever else is running.

Creating a context takes 0.3-1 s (its buffers, and reserving its outputs), so a closed
session's context is emptied and kept for the next one: at most one per session open at
once, which the member's slots bound.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .context import Context


class PrivateContexts:
    """Contexts of one session window each, opened when first needed and kept when given back."""

    def __init__(self, open_context: Callable[[], Context]) -> None:
        self._open = open_context
        self._idle: list[Context] = []
        self._busy: list[Context] = []
        self._lock = threading.Lock()

    def take(self) -> Context:
        """An empty context: a kept one, else a new one."""
        with self._lock:
            ctx = self._idle.pop() if self._idle else None
        if ctx is None:
            ctx = self._open()
        ctx.clear()
        with self._lock:
            self._busy.append(ctx)
        return ctx

    def give_back(self, ctx: Context) -> None:
        """`ctx`'s session ended: empty it and keep it for the next one."""
        with self._lock:
            self._busy.remove(ctx)
        try:
            ctx.clear()
        finally:
            with self._lock:
                self._idle.append(ctx)

    def __len__(self) -> int:
        """Contexts opened so far (in use or kept)."""
        with self._lock:
            return len(self._idle) + len(self._busy)

    def cells(self) -> tuple[int, int]:
        """Positions held by contexts in use, and by kept ones (a kept context holds none: anything else leaks)."""
        with self._lock:
            busy, idle = list(self._busy), list(self._idle)
        return sum(c.held_cells() for c in busy), sum(c.held_cells() for c in idle)

    def close(self) -> None:
        with self._lock:
            contexts, self._idle, self._busy = self._idle + self._busy, [], []
        for ctx in contexts:
            ctx.close()
