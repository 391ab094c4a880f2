"""Members that run in copies (Ray members): each copy's node, load and prefix-cache hits, and what is down.

``/health`` shows them (``copies``, ``degraded``) and ``/metrics`` has a series per copy. A member tells
of its copies by a ``view()`` (``RayMember.view``: a row per copy, as last read); members without one
run in this process or on a server of their own and are not listed. One process serving alone reads
its own members (:func:`local_view`); front ends on a Ray cluster ask the deployment that owns the
copies, which also says which nodes and front-end replicas are gone (``server/ray/keeper.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

ROW_FIELDS = (
    "index",
    "node_ip",
    "node_id",
    "pid",
    "placement",
    "up",
    "sessions",
    "slots",
    "free_slots",
    "waiting",
    "prefix_hits",
    "stats",
)


@dataclass(frozen=True)
class CopiesView:
    """Each copied member's copies (member -> rows of :data:`ROW_FIELDS`), and what is degraded, in words."""

    members: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    degraded: list[str] = field(default_factory=list)


def rows_of(member: Any) -> list[dict[str, Any]] | None:
    """`member`'s copies as rows (None for a member that does not run in copies)."""
    view = getattr(member, "view", None)
    if not callable(view):
        return None
    return [{k: row.get("copy" if k == "index" else k) for k in ROW_FIELDS} for row in view()]


def down_copies(member: str, rows: Iterable[dict[str, Any]]) -> list[str]:
    """What a member's rows say is down, in words."""
    return [
        f"{member}: copy {row['index']} on {row['node_ip']} is down (Ray restarts it where it can; its "
        "sessions are read again on another copy)"
        for row in rows
        if not row["up"]
    ]


def local_view(members: Sequence[Any]) -> CopiesView:
    """The copies of this process's members, as their last read left them (no call to any copy)."""
    found: dict[str, list[dict[str, Any]]] = {}
    degraded: list[str] = []
    for member in members:
        rows = rows_of(member)
        if rows is not None:
            found[member.name] = rows
            degraded += down_copies(member.name, rows)
    return CopiesView(found, degraded)


# (metric, help, row field); all private, as every per-member family (metrics.PRIVATE)
COPY_GAUGES = (
    ("segfuse_member_copy_up", "1 while the member's copy answers, 0 while it is down", "up"),
    ("segfuse_member_copy_sessions", "Sessions the member's copy holds", "sessions"),
    ("segfuse_member_copy_free_slots", "Session slots of the member's copy no session takes", "free_slots"),
    ("segfuse_member_copy_waiting", "Calls queued for the member's copy", "waiting"),
)
COPY_HITS = ("segfuse_member_prefix_cache_copy_hits", "Sessions that started from the copy's prefix cache")
LABELS = ["member", "copy", "node"]


def copy_families(view: CopiesView | None) -> list[Metric]:
    """The per-copy series of `view` (none without one)."""
    if view is None or not view.members:
        return []
    families = [GaugeMetricFamily(name, text, labels=LABELS) for name, text, _ in COPY_GAUGES]
    hits = CounterMetricFamily(*COPY_HITS, labels=LABELS)
    for member, rows in view.members.items():
        for row in rows:
            labels = [member, str(row["index"]), row["node_ip"]]
            for family, (_, _, key) in zip(families, COPY_GAUGES):
                if row[key] is not None:
                    family.add_metric(labels, float(row[key]))
            if row["prefix_hits"] is not None:
                hits.add_metric(labels, row["prefix_hits"])
    return [*families, hits]


__all__ = ["ROW_FIELDS", "CopiesView", "copy_families", "down_copies", "local_view", "rows_of"]
