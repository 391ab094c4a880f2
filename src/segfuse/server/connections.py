"""How the server holds its HTTP/1.1 connections, so that slow or idle ones cannot keep others out.

uvicorn's ``limit_concurrency`` counts every open connection, idle and half-sent ones too: 64 sockets that
never finish their headers made every other client's request a 503 until the header deadline closed them.
:func:`h11_protocol` subclasses uvicorn's h11 protocol to keep the two kinds apart:

- a connection is *pending* while it has no request: its request line and headers are still coming, or it
  idles kept alive between requests. It has ``header_timeout_s`` to send them. Once it has waited
  ``PENDING_GRACE_S`` it counts against ``max_pending_per_client`` (its address) and
  ``max_pending_connections`` (all); past either bound, the oldest counted connection of that address (or of
  all) is closed. Closing the oldest rather than the newest means a slow client that shares an address with
  quick ones (a proxy, a NAT, local processes) cannot lock them out: a quick client's connection sends its
  request within a round trip and never counts, while slow ones age to the front and go first. The grace
  keeps a burst of new connections, whose requests are on the way, from counting at all;
- a request is *in flight* from its headers to the end of its answer (a stream holds one throughout);
  ``limit_concurrency`` bounds those: more get 503 ``server_busy`` at once.

Refusals are logged, at most one line every ``REFUSAL_LOG_S`` (what was refused, how often, from where).
uvicorn's own bookkeeping stays as it is: every connection is in its ``server_state.connections``, which
graceful shutdown closes.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from ..config import LimitsSection
from .guards import error_body

if TYPE_CHECKING:  # the protocol's base for the type checker; at run time h11_protocol puts it in (uvicorn is an extra)
    from uvicorn.protocols.http.h11_impl import H11Protocol as _H11
else:
    _H11 = object

log = logging.getLogger("segfuse.server")

PENDING_GRACE_S = 1.0  # a connection without a request for this long counts as pending
REFUSAL_LOG_S = 10.0  # at most one log line about refused connections this often


class PendingConnections:
    """Connections waiting for a request, oldest first, per client address and in all."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client, self.total = per_client, total
        self._all: dict[Hashable, str] = {}  # connection -> its address, in the order they became pending
        self._by_address: dict[str, dict[Hashable, None]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def of(self, address: str) -> int:
        """Pending connections of `address`."""
        return len(self._by_address.get(address, ()))

    def add(self, conn: Hashable, address: str) -> list[tuple[Hashable, str]]:
        """Count `conn` (of `address`) as the newest pending connection; the connections to close to keep
        within the bounds, oldest first, each with the setting that closes it (no longer counted)."""
        self.discard(conn)
        self._all[conn] = address
        mine = self._by_address.setdefault(address, {})
        mine[conn] = None
        closing = []
        while len(mine) > self.per_client:
            closing.append((self._pop(next(iter(mine))), "max_pending_per_client"))
        while len(self._all) > self.total:
            closing.append((self._pop(next(iter(self._all))), "max_pending_connections"))
        return closing

    def discard(self, conn: Hashable) -> None:
        """`conn` is pending no more (it sent a request, or closed)."""
        address = self._all.pop(conn, None)
        if address is None:
            return
        mine = self._by_address[address]
        del mine[conn]
        if not mine:
            del self._by_address[address]

    def _pop(self, conn: Hashable) -> Hashable:
        self.discard(conn)
        return conn


class RefusalLog:
    """Warnings about refused connections and requests: the first at once, then at most one line every
    `every_s` seconds counting what was refused meanwhile (a flood of sockets must not flood the log)."""

    def __init__(self, limits: LimitsSection, every_s: float = REFUSAL_LOG_S) -> None:
        self.limits, self.every_s = limits, every_s
        self.counts: Counter[tuple[str, str]] = Counter()  # (setting, address) -> refusals since the last line
        self._last = float("-inf")
        self._due: Any = None  # the timer that writes the next line

    def note(self, setting: str, address: str, loop: Any) -> None:
        """One refusal by `setting` of a client at `address`."""
        self.counts[setting, address] += 1
        if loop.time() - self._last >= self.every_s:
            self.flush(loop)
        elif self._due is None:
            self._due = loop.call_at(self._last + self.every_s, self.flush, loop)

    def flush(self, loop: Any) -> None:
        """Write what was refused since the last line (nothing when nothing was)."""
        if self._due is not None:
            self._due.cancel()
            self._due = None
        if not self.counts:
            return
        self._last = loop.time()
        parts = []
        for setting, what in (
            ("limit_concurrency", "requests answered 503"),
            ("max_pending_per_client", "connections closed before their request"),
            ("max_pending_connections", "connections closed before their request"),
        ):
            by_address = Counter({a: n for (s, a), n in self.counts.items() if s == setting})
            if by_address:
                top = ", ".join(f"{a or 'unknown'}: {n}" for a, n in by_address.most_common(3))
                parts.append(
                    f"{what} past [limits] {setting} {getattr(self.limits, setting)}: {by_address.total()} ({top})"
                )
        self.counts.clear()
        log.warning("refused: %s", "; ".join(parts))


class InFlight:
    """Requests in flight (admitted, answer not ended) against ``limit_concurrency``."""

    def __init__(self, limit: int) -> None:
        self.limit, self.count = limit, 0

    def enter(self) -> bool:
        """Admit one more request; False when `limit` are in flight already."""
        if self.count >= self.limit:
            return False
        self.count += 1
        return True

    def leave(self) -> None:
        self.count -= 1


async def server_busy(scope: Any, receive: Any, send: Any, limit: int) -> None:
    """503 ``server_busy``: the request is not read, and the connection closes."""
    message = (
        f"the server is answering as many requests as it takes at once ([limits] limit_concurrency "
        f"{limit}); retry in a moment"
    )
    headers, body = error_body("server_busy", message, "server_error")
    headers += [(b"connection", b"close"), (b"retry-after", b"1")]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BoundedConnection(_H11):
    """What the bounds add to uvicorn's h11 protocol: pending timers and requests admitted in flight.

    :func:`h11_protocol` puts it before ``H11Protocol`` in one class per server, whose class attributes hold
    that server's counts, shared by all of its connections."""

    limits: LimitsSection
    pending: PendingConnections
    in_flight: InFlight
    refusals: RefusalLog
    idle: Any  # h11's IDLE state: the connection has no request
    _header_timer: Any = None  # closes the connection if its request line and headers are late
    _grace_timer: Any = None  # counts it as pending once it has waited a moment

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._app = self.app
        self.app = self._admit  # what uvicorn runs for each request it has read

    @property
    def address(self) -> str:
        return self.client[0] if self.client else ""

    async def _admit(self, scope: Any, receive: Any, send: Any) -> None:
        if not self.in_flight.enter():
            self.refusals.note("limit_concurrency", self.address, self.loop)
            return await server_busy(scope, receive, send, self.in_flight.limit)
        try:
            await self._app(scope, receive, send)
        finally:
            self.in_flight.leave()

    def _track(self) -> None:
        """Arm the pending timers while the connection has no request, disarm them once it has one."""
        if self.conn.their_state is self.idle and not self.transport.is_closing():
            if self._header_timer is None:  # the deadline counts from the connection or the last answer
                self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._too_slow)
                self._grace_timer = self.loop.call_later(PENDING_GRACE_S, self._count)
        else:
            self._untrack()

    def _untrack(self) -> None:
        for timer in (self._header_timer, self._grace_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._grace_timer = None
        self.pending.discard(self)

    def _count(self) -> None:
        self._grace_timer = None
        for conn, setting in self.pending.add(self, self.address):
            assert isinstance(conn, BoundedConnection)
            self.refusals.note(setting, conn.address, self.loop)
            conn._close()

    def _too_slow(self) -> None:
        self._header_timer = None
        self._close()

    def _close(self) -> None:
        self._untrack()
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._track()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._untrack()
        super().connection_lost(exc)


def h11_protocol(limits: LimitsSection) -> type:
    """uvicorn's h11 protocol class with the bounds of `limits` (this module's docstring); one class per
    server: its pending connections and requests in flight are counted across its connections."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    counts = {
        "limits": limits,
        "pending": PendingConnections(limits.max_pending_per_client, limits.max_pending_connections),
        "in_flight": InFlight(limits.limit_concurrency),
        "refusals": RefusalLog(limits),
        "idle": h11.IDLE,
    }
    return type("BoundedH11", (BoundedConnection, H11Protocol), counts)


__all__ = [
    "PENDING_GRACE_S",
    "REFUSAL_LOG_S",
    "BoundedConnection",
    "InFlight",
    "PendingConnections",
    "RefusalLog",
    "h11_protocol",
    "server_busy",
]
