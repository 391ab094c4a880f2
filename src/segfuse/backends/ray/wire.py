"""What a copy (``host.py``) and its callers (``member.py``) pass each other, besides the member's own data."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from ...errors import MemberFailedError
from ..base import Capabilities, Occupancy


class SessionLost(MemberFailedError):
    """A copy holds no session by this id: it expired, or the copy was restarted since it opened."""


class CopyLost(MemberFailedError):
    """A copy stopped answering (its process died, its node left, or Ray is restarting it)."""


@dataclass(frozen=True)
class HostInfo:
    """One copy: the member it loaded and where it runs."""

    name: str
    capabilities: Capabilities
    slots: int | None
    n_params: int | None
    placement: str | None  # the member's own words (CPU, GPU: 31/31 layers...)
    node_id: str
    node_ip: str
    pid: int
    incarnation: str  # new each time Ray (re)starts the copy: its sessions are gone


@dataclass(frozen=True)
class Opened:
    """A session opened on a copy."""

    sid: str
    stops: tuple[str, ...]
    room: int
    streams_text: bool
    load: int  # sessions open on the copy now


@dataclass(frozen=True)
class Done:
    """The end of a call: one value (or exception) per item, and the copy's load and rooms after it."""

    values: list[Any]
    load: int
    rooms: list[int | None]


@dataclass(frozen=True)
class Held:
    """What a copy holds: its member's occupancy, its sessions, and its work so far."""

    occupancy: Occupancy
    sessions: int
    stats: dict[str, int]
    info: HostInfo
    waiting: int = 0  # calls queued for the member's thread now


def portable(exc: BaseException) -> Exception:
    """`exc` as it can travel to a caller: itself where it pickles (its type and fields survive), else a
    RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc if isinstance(exc, Exception) else RuntimeError(f"{type(exc).__name__}: {exc}")
