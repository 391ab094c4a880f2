"""Prometheus metrics for ``GET /metrics`` (the ``prometheus-client`` package).

Each app has its own ``CollectorRegistry``, so several apps in one process
(tests, embedders) never clash. The request counters, the queue, the rounds and
what each member holds (free slots, KV-cache cells) are read from the worker
when scraped, so they always agree with ``/health``;
the rest (tokens, latencies, member departures) is observed by the worker as
each generation's events happen, whether or not a client still reads them, so
that a completed request is always observed once.

Every family with a ``member`` label is private (``PRIVATE``): the prefix cache's per member (how many
tokens a request found cached betrays, token by token, what someone else sent), the KV cells open
sessions hold (their lengths), and the members' very names (a server offers models it loads on demand,
some never loaded, some that failed: which files it holds is the operator's business). ``render(private=False)``
leaves them out: what a scrape without the API key gets when the server has one, the aggregates only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..backends.base import Occupancy
from ..backends.prefix_cache import PrefixStats
from ..types import Result
from .copies import CopiesView, copy_families

# How each request that reached the worker ended (429s included): the worker's counters of the same name.
OUTCOMES = ("completed", "cancelled", "invalid", "failed", "rejected")
# Seconds, from the request's acceptance: CPU answers take from a fraction of a second to minutes.
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
FIRST_SEGMENT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class WorkerView(Protocol):
    """What the metrics read from the worker's queue (``worker/job_queue.py``'s ``JobQueue`` provides it)."""

    max_concurrent: int
    queue_size: int

    def snapshot(self) -> dict[str, int]: ...

    def view(self) -> tuple[int, int, Mapping[str, Occupancy]]: ...


class _WorkerCollector(Collector):
    """The worker's counters and queue, read at scrape time."""

    def __init__(self, worker: WorkerView) -> None:
        self.worker = worker

    def collect(self) -> Iterable[Metric]:
        counters = self.worker.snapshot()
        waiting, running, held = self.worker.view()
        requests = CounterMetricFamily(
            "segfuse_requests",
            "Requests that reached the worker, by how they ended "
            "(rejected: the queue was full, 429; invalid: the members found the input bad)",
            labels=["outcome"],
        )
        for outcome in OUTCOMES:
            requests.add_metric([outcome], counters.get(outcome, 0))
        yield requests
        yield CounterMetricFamily(
            "segfuse_requests_accepted", "Requests queued for the worker", value=counters.get("accepted", 0)
        )
        yield CounterMetricFamily(
            "segfuse_rounds", "Fusion rounds run (draft, verify, pick a segment)", value=counters.get("rounds", 0)
        )
        yield GaugeMetricFamily("segfuse_generations_in_flight", "Generations running now", value=int(running))
        yield GaugeMetricFamily("segfuse_queue_depth", "Requests waiting for a free slot", value=waiting)
        yield GaugeMetricFamily(
            "segfuse_queue_capacity", "How many requests may wait (queue_size)", value=self.worker.queue_size
        )
        yield GaugeMetricFamily(
            "segfuse_max_concurrent", "Generations run together at most", value=self.worker.max_concurrent
        )
        yield from _occupancy(held)


def _occupancy(held: Mapping[str, Occupancy]) -> Iterable[Metric]:
    """Per member, what it held after the worker's last step (members that cannot tell are left out)."""
    free = GaugeMetricFamily(
        "segfuse_member_free_slots", "Session slots of the member no request holds", labels=["member"]
    )
    cells = GaugeMetricFamily(
        "segfuse_member_cache_cells",
        "KV-cache positions the member's open sessions "
        "hold, summed over their sequences (0 when no request is in flight)",
        labels=["member"],
    )
    stray = GaugeMetricFamily(
        "segfuse_member_stray_cells",
        "KV-cache positions held by no session and no prefix-cache entry (a leak: always 0)",
        labels=["member"],
    )
    for name, o in held.items():
        if o.free_slots is not None:
            free.add_metric([name], o.free_slots)
        if o.cache_cells is not None:
            cells.add_metric([name], o.cache_cells)
        if o.stray_cells is not None:
            stray.add_metric([name], o.stray_cells)
    yield free
    yield cells
    yield stray
    yield from _prefix_caches({name: o.prefix for name, o in held.items() if o.prefix is not None})


# The prefix cache's fields: (metric suffix, help, counter?)
PREFIX_METRICS = (
    ("bound", "KV-cache cells the member's prefix cache may hold", False),
    ("cells", "KV-cache cells the member's prefix cache holds (cached prompts and answers)", False),
    ("entries", "Prefixes the member's cache holds", False),
    ("hits", "Sessions that started from a cached prefix", True),
    ("misses", "Sessions that found no cached prefix", True),
    ("reused_tokens", "Prompt tokens not decoded thanks to the prefix cache", True),
    ("evictions", "Prefix-cache entries dropped to make room", True),
    ("restored", "Prefix-cache entries read back from its directory (prefix_cache_dir)", True),
    ("saved", "Prefix-cache entries written to its directory (prefix_cache_dir)", True),
)


def _prefix_caches(caches: Mapping[str, PrefixStats]) -> Iterable[Metric]:
    """Per member, its prefix cache: what it holds now (gauges) and what it has done (counters)."""
    for field, text, counter in PREFIX_METRICS:
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(
            f"segfuse_member_prefix_cache_{field}", text, labels=["member"]
        )
        for name, stats in caches.items():
            family.add_metric([name], getattr(stats, field))
        yield family


# Metric families only a scrape holding the API key sees (a server without a key shows them to all): every
# family per member (segfuse_member_*), copies included; the aggregates (requests, queue, latencies) stay open.
PRIVATE = ("segfuse_member_",)


class Families:
    """Metric families as ``generate_latest`` reads them: those of `sources`, the private ones left out
    unless `private`."""

    def __init__(self, *sources: Iterable[Metric], private: bool = True) -> None:
        self.sources, self.private = sources, private

    def collect(self) -> Iterable[Metric]:
        for source in self.sources:
            for family in source:
                if self.private or not family.name.startswith(PRIVATE):
                    yield family


class ServerMetrics:
    """One app's registry and the metrics ``serving`` observes."""

    def __init__(self, worker: WorkerView) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_WorkerCollector(worker))
        r = self.registry
        self.output_tokens = Counter(
            "segfuse_output_tokens",
            "Answer tokens generated (the winners' tokens, as usage.completion_tokens)",
            registry=r,
        )
        self.time_to_first_segment = Histogram(
            "segfuse_time_to_first_segment_seconds",
            "From the request's acceptance (queueing included) to its first accepted segment",
            buckets=FIRST_SEGMENT_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "segfuse_request_latency_seconds",
            "From the request's acceptance (queueing included) to its complete answer; completed requests only",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.member_faults = Counter(
            "segfuse_member_faults", "Members dropped from a query after a fault", ["member"], registry=r
        )
        self.member_exits = Counter(
            "segfuse_member_exits", "Members that left a query by Model Exit", ["member"], registry=r
        )

    def members(self, names: Iterable[str]) -> None:
        """Start each member's series at 0, so dashboards see them before the first departure."""
        for name in names:
            self.member_faults.labels(member=name)
            self.member_exits.labels(member=name)

    def first_segment(self, accepted: float) -> None:
        """A request's first segment arrived; ``accepted`` is its ``time.time()`` at acceptance."""
        self.time_to_first_segment.observe(max(0.0, time.time() - accepted))

    def done(self, accepted: float, result: Result) -> None:
        """A request completed with ``result``."""
        self.latency.observe(max(0.0, time.time() - accepted))
        self.output_tokens.inc(max(0, result.stats.tokens))
        for departure in result.departures:
            counter = self.member_faults if departure.kind == "fault" else self.member_exits
            counter.labels(member=departure.model).inc()

    def render(self, private: bool = True, copies: CopiesView | None = None) -> bytes:
        """The Prometheus text, with a series per member copy in `copies`; without `private`, the families
        that tell of other clients' prompts left out."""
        families = Families(self.registry.collect(), copy_families(copies), private=private)
        return generate_latest(families)

    content_type = CONTENT_TYPE_LATEST


__all__ = ["OUTCOMES", "PRIVATE", "Families", "ServerMetrics"]
