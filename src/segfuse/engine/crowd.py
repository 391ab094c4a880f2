"""How many generations advance together on one scheduler, as the engine's code sees it while it runs.

A leader that reads drafts does so only while few answers are in flight (``FusionOptions.draft_users``):
with more, each user's next token already rides in one batched decode with the others', and a pass that
reads a draft for one of them would run beside that batch, not in it. The scheduler sets the count around
the steps it advances; one generation driven alone (``fuse``) sees 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_IN_FLIGHT: ContextVar[int] = ContextVar("segfuse_in_flight", default=1)


def in_flight() -> int:
    """The generations advancing together now (1 outside a scheduler)."""
    return _IN_FLIGHT.get()


@contextmanager
def advancing_together(n: int) -> Iterator[None]:
    """Within the block, :func:`in_flight` is `n`."""
    token = _IN_FLIGHT.set(n)
    try:
        yield
    finally:
        _IN_FLIGHT.reset(token)
