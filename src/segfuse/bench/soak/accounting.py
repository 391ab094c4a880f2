"""What the soak checks, as pure functions over what the client saw and what the server counted.

Every request the client sent ends in one *client outcome*:

- ``answered``: 200 with text (a stream with its finish chunk);
- ``empty``: 200 without text (an "empty 200"), or a stream that ended without a finish chunk;
- ``abandoned``: the client hung up or timed out on purpose;
- ``rejected``: 429, the queue was full;
- ``invalid``: 400 from the members (a prompt too long): counted by the server;
- ``refused``: the 4xx a malformed request must get, before it reaches the worker;
- ``failed``: a member fault ended it (500, or an error event in the stream);
- ``unexpected``: anything else (a wrong status, a dropped connection): a finding;
- ``lost``: no answer before the run's deadline.

:func:`reconcile` sets them against the server's counters (``/health``) and
``/metrics``, both read before and after the run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..common.load import percentile

if TYPE_CHECKING:
    from .traffic import Action

CLIENT_OUTCOMES = ("answered", "empty", "abandoned", "rejected", "invalid", "refused", "failed", "unexpected", "lost")
# Client outcomes of requests the worker accepted (abandoned: it may have finished first, or not).
REACHED = frozenset({"answered", "empty", "abandoned", "invalid", "failed"})
COUNTERS = ("accepted", "rejected", "started", "completed", "cancelled", "invalid", "failed")


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the start of the run."""

    index: int
    kind: str
    phase: int
    cycle: int  # of the plan; -1 outside it (probes, warm-up)
    start_s: float
    latency_s: float
    outcome: str
    expected: tuple[str, ...]
    status: int | None = None
    code: str | None = None  # the error code of an error body or event
    ttfs_s: float | None = None  # to the first text
    tokens: int | None = None  # usage.completion_tokens
    text_chars: int = 0
    response_id: str | None = None
    finishes: int = 0  # finish chunks in a stream (one, unless something is duplicated)
    detail: str | None = None

    @classmethod
    def of(
        cls, action: Action, start_s: float, latency_s: float, outcome: str, expected: tuple[str, ...], **more: Any
    ) -> Record:
        """The record of `action` (its index, kind, phase and cycle)."""
        return cls(action.index, action.kind, action.phase, action.cycle, start_s, latency_s, outcome, expected, **more)

    @property
    def as_expected(self) -> bool:
        return self.outcome in self.expected


@dataclass(frozen=True)
class Check:
    """One comparison: what the client saw against what the server says."""

    name: str
    client: str
    server: str
    ok: bool


def tally(records: Iterable[Record]) -> dict[str, int]:
    """Requests per client outcome (every outcome listed, zeros included)."""
    seen = Counter(r.outcome for r in records)
    return {o: seen.get(o, 0) for o in CLIENT_OUTCOMES}


def by_kind(records: Iterable[Record]) -> dict[str, dict[str, int]]:
    """Client outcomes per kind of request."""
    table: dict[str, Counter[str]] = {}
    for r in records:
        table.setdefault(r.kind, Counter())[r.outcome] += 1
    return {kind: {o: c.get(o, 0) for o in CLIENT_OUTCOMES} for kind, c in table.items()}


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def duplicates(records: Sequence[Record]) -> list[str]:
    """Why any answer looks duplicated: a response id seen twice, a stream with several finishes."""
    ids = Counter(r.response_id for r in records if r.response_id)
    found = [f"response id {i} seen {n} times" for i, n in ids.items() if n > 1]
    found += [f"request {r.index} ({r.kind}): {r.finishes} finish chunks" for r in records if r.finishes > 1]
    return found


def reconcile(
    records: Sequence[Record], counters: Mapping[str, float], metrics: Mapping[str, float], idle: Mapping[str, int]
) -> list[Check]:
    """The accounting checks. `counters` and `metrics` are changes over the run (/health's counters;
    /metrics samples by :func:`metric_key`); `idle` is the queue after the run (waiting, running)."""
    n = tally(records)
    c = {k: int(counters.get(k, 0)) for k in COUNTERS}
    reached = sum(n[o] for o in REACHED)
    answered = n["answered"] + n["empty"]
    ended = c["completed"] + c["cancelled"] + c["invalid"] + c["failed"]
    checks = [
        Check("no request lost by the client", f"{n['lost']} without an answer", "", n["lost"] == 0),
        Check(
            "every accepted request ended once",
            f"queue after the run: {idle.get('waiting')} waiting, {idle.get('running')} running",
            f"accepted {c['accepted']} = ended {ended}",
            c["accepted"] == ended and not idle.get("waiting") and not idle.get("running"),
        ),
        Check(
            "accepted = requests that reached the worker", f"{reached}", f"{c['accepted']}", c["accepted"] == reached
        ),
        Check(
            "completed: the answered, and abandoned ones that finished first",
            f"{answered} answered, {n['abandoned']} abandoned",
            f"{c['completed']} completed",
            answered <= c["completed"] <= answered + n["abandoned"],
        ),
        Check(
            "completed + cancelled = answered + abandoned",
            f"{answered + n['abandoned']}",
            f"{c['completed'] + c['cancelled']}",
            c["completed"] + c["cancelled"] == answered + n["abandoned"],
        ),
    ]
    checks += [
        Check(f"{outcome} (server) = {outcome} (client)", f"{n[outcome]}", f"{c[outcome]}", n[outcome] == c[outcome])
        for outcome in ("rejected", "invalid", "failed")
    ]
    dupes = duplicates(records)
    checks.append(Check("no duplicated answer", "; ".join(dupes[:3]) or "none", "", not dupes))
    checks.append(Check("no empty 200", f"{n['empty']}", "", n["empty"] == 0))
    wrong = [r for r in records if not r.as_expected and r.outcome not in ("empty", "lost")]
    checks.append(
        Check(
            "every request got the answer its kind expects",
            f"{len(wrong)} otherwise" + (f" (first: {_brief(wrong[0])})" if wrong else ""),
            "",
            not wrong,
        )
    )
    checks += agree(counters, metrics)
    return checks


def _brief(r: Record) -> str:
    return f"#{r.index} {r.kind}: {r.outcome}, status {r.status}, {r.code or ''} {r.detail or ''}".strip()


def metric_key(name: str, labels: Mapping[str, str] | None = None) -> str:
    """A flat key for one Prometheus sample: ``name{label=value,...}``."""
    inner = ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items()))
    return f"{name}{{{inner}}}" if inner else name


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric_key: value}, through prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        metric_key(s.name, s.labels): s.value for family in text_string_to_metric_families(text) for s in family.samples
    }


def agree(counters: Mapping[str, float], metrics: Mapping[str, float]) -> list[Check]:
    """/metrics against /health over the run: request outcomes, acceptances, completed-request observations."""
    checks = []
    for outcome in ("completed", "cancelled", "invalid", "failed", "rejected"):
        got = metrics.get(metric_key("segfuse_requests_total", {"outcome": outcome}))
        checks.append(
            Check(
                f"/metrics requests_total{{{outcome}}} = /health",
                f"{counters.get(outcome)}",
                f"{got}",
                got == counters.get(outcome),
            )
        )
    got = metrics.get("segfuse_requests_accepted_total")
    checks.append(
        Check(
            "/metrics requests_accepted_total = /health",
            f"{counters.get('accepted')}",
            f"{got}",
            got == counters.get("accepted"),
        )
    )
    got = metrics.get("segfuse_request_latency_seconds_count")
    checks.append(
        Check(
            "/metrics latency observations = completed",
            f"{counters.get('completed')}",
            f"{got}",
            got == counters.get("completed"),
        )
    )
    return checks


# --------------------------------------------------------------------------- memory and latency


def latency_tenths(records: Sequence[Record], kinds: frozenset[str]) -> dict[str, Any]:
    """p50/p95 latency of answered `kinds` in the first and in the last tenth of the run's cycles.

    Tenths of cycles, not of time: every cycle holds the same levels and kinds, so the two tenths
    hold the same mix (at least one cycle each; the last cycle counts only if it ran whole).
    """
    cycles = sorted({r.cycle for r in records if r.cycle >= 0})
    whole = [c for c in cycles if any(r.cycle == c and r.kind == "burst" for r in records)]  # its burst ran
    if len(whole) < 2:
        return {"cycles": len(whole), "first": None, "last": None, "p95_ratio": None}
    k = max(1, len(whole) // 10)

    def tenth(chosen: list[int]) -> dict[str, Any]:
        lat = [r.latency_s for r in records if r.cycle in chosen and r.kind in kinds and r.outcome == "answered"]
        starts = [r.start_s for r in records if r.cycle in chosen]
        return {
            "cycles": chosen,
            "from_s": min(starts),
            "to_s": max(starts),
            "requests": len(lat),
            "p50_s": percentile(lat, 50),
            "p95_s": percentile(lat, 95),
        }

    first, last = tenth(whole[:k]), tenth(whole[-k:])
    ratio = last["p95_s"] / first["p95_s"] if first["p95_s"] and last["p95_s"] is not None else None
    return {"cycles": len(whole), "first": first, "last": last, "p95_ratio": ratio}


@dataclass
class Memory:
    """The server's resident memory at the start, after warm-up and at the end (idle each time)."""

    start_mb: float | None
    warm_mb: float | None
    end_mb: float | None
    requests_since_warm: int  # requests the worker accepted between the warm and the end readings
    samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds, MiB), over the run

    @property
    def growth(self) -> float | None:
        """From after warm-up to the end, as a fraction of the warm reading."""
        if not self.warm_mb or self.end_mb is None:
            return None
        return (self.end_mb - self.warm_mb) / self.warm_mb

    @property
    def per_1000_mb(self) -> float | None:
        if self.warm_mb is None or self.end_mb is None or self.requests_since_warm <= 0:
            return None
        return (self.end_mb - self.warm_mb) * 1000 / self.requests_since_warm

    def to_dict(self) -> dict[str, Any]:
        return {
            "start_mb": self.start_mb,
            "warm_mb": self.warm_mb,
            "end_mb": self.end_mb,
            "requests_since_warm": self.requests_since_warm,
            "growth": self.growth,
            "growth_per_1000_requests_mb": self.per_1000_mb,
        }


# --------------------------------------------------------------------------- targets

# Printed next to the measured values, never enforced: a shared machine is noisy.
TARGETS = {
    "lost_or_duplicated": ("<=", 0, "requests lost or duplicated"),
    "empty_200": ("<=", 0, "empty 200s"),
    "memory_growth": ("<=", 0.05, "resident memory growth from after warm-up to the end"),
    "held_when_idle": ("<=", 0, "idle checkpoints with a slot or KV cell held"),
    "p95_drift": ("<=", 1.2, "p95 latency, last tenth / first tenth"),
}


def targets(
    records: Sequence[Record], memory: Memory, held_when_idle: int, p95_ratio: float | None
) -> dict[str, dict[str, Any]]:
    """Each target with its measured value and whether it was met (None: not measured)."""
    n = tally(records)
    measured = {
        "lost_or_duplicated": n["lost"] + len(duplicates(records)),
        "empty_200": n["empty"],
        "memory_growth": memory.growth,
        "held_when_idle": held_when_idle,
        "p95_drift": p95_ratio,
    }
    out = {}
    for key, (op, bound, what) in TARGETS.items():
        value = measured[key]
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        out[key] = {"measured": value, "target": f"{op} {bound}", "met": met, "what": what}
    return out


__all__ = [
    "CLIENT_OUTCOMES",
    "TARGETS",
    "Check",
    "Memory",
    "Record",
    "agree",
    "by_kind",
    "delta",
    "duplicates",
    "latency_tenths",
    "metric_key",
    "parse_metrics",
    "reconcile",
    "tally",
    "targets",
]
