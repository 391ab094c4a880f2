"""The metrics of several front-end replicas as one: each replica's figures added up.

Every replica publishes its own families (its requests, tokens, latencies, queue) to the shared
state (``state.py``) every :data:`PUBLISH_S` and whenever it is scraped; a scrape, whichever replica
it reaches, adds its own fresh figures to the others' last ones. Counters and histograms are summed
over every replica that ever published (a replica that died keeps its last figures: a total never
goes down); gauges only over replicas heard from within :data:`STALE_S` (one that died waits for
nothing). What a replica reads of the members' copies (their slots, caches, prefix caches: the same
copies for every replica) is taken from the scraped replica alone, never summed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client.metrics_core import Metric

PUBLISH_S = 1.0
STALE_S = 10.0
SUMMED_MEMBER = ("segfuse_member_faults", "segfuse_member_exits")  # counted by each replica, per member

Sample = tuple[str, dict[str, str], float]
Family = tuple[str, str, str, list[Sample]]  # name, type, help, samples


def plain(metrics: Iterable[Metric]) -> list[Family]:
    """Metric families as plain data (what travels between processes)."""
    return [
        (m.name, m.type, m.documentation, [(s.name, dict(s.labels), float(s.value)) for s in m.samples])
        for m in metrics
    ]


def own_only(name: str) -> bool:
    """Whether a family describes the members' shared copies (read, never summed, across replicas)."""
    return name.startswith("segfuse_member_") and name not in SUMMED_MEMBER


def merge(
    own: Sequence[Family], others: Iterable[tuple[float, Sequence[Family]]], stale_s: float = STALE_S
) -> list[Metric]:
    """`own` figures and the others' (each with its age in seconds) as one set of families (module docstring)."""
    order: list[str] = []
    kinds: dict[str, tuple[str, str]] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    sources: list[tuple[bool, float, Sequence[Family]]] = [(True, 0.0, own)]
    sources += [(False, age, families) for age, families in others]
    for is_own, age, families in sources:
        for name, kind, text, samples in families:
            if (own_only(name) and not is_own) or (kind == "gauge" and age > stale_s):
                continue
            if name not in kinds:
                order.append(name)
                kinds[name], values[name] = (kind, text), {}
            _add(values[name], samples)
    merged = []
    for name in order:
        kind, text = kinds[name]
        family = Metric(name, text, kind)
        for (sample, labels), value in values[name].items():
            family.add_sample(sample, dict(labels), value)
        merged.append(family)
    return merged


def _add(into: dict[Any, float], samples: Iterable[Sample]) -> None:
    for sample, labels, value in samples:
        key = (sample, tuple(sorted(labels.items())))
        if key not in into:
            into[key] = value
        elif sample.endswith("_created"):  # when the series began: the earliest replica's
            into[key] = min(into[key], value)
        else:
            into[key] += value


__all__ = ["PUBLISH_S", "STALE_S", "Family", "merge", "own_only", "plain"]
