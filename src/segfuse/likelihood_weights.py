"""Pooling weights fitted on scored items: the members' worth on your own multiple-choice data.

An item is every member's scores of its choices and the indices of the right ones (the records
``segfuse.eval.likelihood_study`` writes). The weights are the point of a grid over the
simplex that gets the most items right, ties broken by the mean log-probability the pool
gives the right choice (softmax over the item's choices), then by closeness to uniform.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backends.likelihood import ContinuationScore
from .likelihood import Rule, log_softmax


@dataclass(frozen=True)
class ScoredItem:
    """One item's scores by every member and the right choices."""

    members: Mapping[str, Sequence[ContinuationScore]]
    correct: tuple[int, ...]

    def right(self, fused: Sequence[float]) -> bool:
        return max(range(len(fused)), key=fused.__getitem__) in self.correct


def item_from_record(record: Mapping[str, Any]) -> ScoredItem:
    """A study record (JSON) as a :class:`ScoredItem`."""
    sizes = record["bytes"]
    members = {
        name: [
            ContinuationScore(lp, tok, size, greedy)
            for lp, tok, size, greedy in zip(row["logprob"], row["tokens"], sizes, row["greedy"])
        ]
        for name, row in record["members"].items()
    }
    return ScoredItem(members, tuple(record["correct"]))


def read_items(source: str | Path) -> list[ScoredItem]:
    """Scored items from a JSONL file of records, or from every ``*.jsonl`` file of a folder."""
    path = Path(source)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    return [
        item_from_record(json.loads(line))
        for f in files
        for line in f.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


def simplex(names: Sequence[str], step: float) -> list[dict[str, float]]:
    """Every weighting of `names` in multiples of `step` that sums to 1."""
    parts = round(1 / step)
    points = []
    for combo in itertools.product(range(parts + 1), repeat=len(names) - 1):
        if sum(combo) <= parts:
            shares = [*combo, parts - sum(combo)]
            points.append({n: s / parts for n, s in zip(names, shares)})
    return points


def evaluate(rule: Rule, items: Sequence[ScoredItem]) -> tuple[int, float]:
    """(items right, mean log-probability of the right choice) under `rule`."""
    right, fit = 0, 0.0
    for item in items:
        fused = rule.fuse(item.members)
        right += item.right(fused)
        logs = log_softmax(fused)
        fit += max(logs[i] for i in item.correct) if item.correct else 0.0
    return right, fit / max(len(items), 1)


def fit_weights(rule: Rule, items: Sequence[ScoredItem], step: float | None = None) -> dict[str, float]:
    """The grid point of weights for `rule` that does best on `items` (see the module docstring)."""
    if not items:
        raise ValueError("no items to fit weights on")
    names = list(items[0].members)
    step = step or (0.1 if len(names) <= 4 else 0.25)
    uniform = 1 / len(names)

    def key(weights: dict[str, float]) -> tuple[int, float, float]:
        right, fit = evaluate(Rule(rule.pool, rule.norm, weights), items)
        spread = math.fsum((w - uniform) ** 2 for w in weights.values())
        return right, round(fit, 9), -spread

    return max(simplex(names, step), key=key)
