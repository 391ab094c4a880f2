"""Rebuilding tables and plots from the JSONL records of an output folder.

Every number is computed over the items that *every* system of the file has
finished ("common items"), so systems are always compared on the same
prompts. When some systems finished more items than others (a study that ran
the cheap systems further), each larger set of items gets its own section with
only the systems that finished all of it. Accuracy intervals are Wilson score
95 % intervals (good for small n and for accuracies near 0 or 1). IFEval's instruction-level accuracies pool
all instructions of the common prompts (their interval treats instructions as
independent, which slightly understates it). Systems run on the same items are
also compared pairwise, item by item, with an exact McNemar test on the items
where exactly one of the two was right.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from ..engine import loops
from ..errors import InvalidRequestError
from .runner import read_records
from .tasks import TASKS, Task

Z95 = 1.959964


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion."""
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass
class Row:
    """One system's summary over the common items."""

    system: str
    n: int
    accuracy: dict[str, tuple[int, int]]  # metric -> (successes, trials)
    mean_total_s: float
    mean_ttft_s: float | None
    mean_calls: float
    calls_per_round: float | None  # segment-level systems only: member calls / rounds
    mean_tokens: float
    errors: int
    wins: dict[str, int]
    at_limit: float = 0.0  # share of answers that ran out of tokens
    looping: float = 0.0  # share of answers with a repeated word 8-gram (3 times or more)

    def rate(self, metric: str) -> float:
        k, n = self.accuracy[metric]
        return k / n if n else 0.0


def latest(records: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The last record per (item, system)."""
    return {(r["id"], r["system"]): r for r in records}


def passed(record: dict[str, Any], metric: str) -> bool:
    """Whether a record passed a prompt-level metric (an errored record has only `correct`)."""
    return bool(record.get(metric, record.get("correct")))


def _ids_by_system(by_key: Mapping[tuple[str, str], dict[str, Any]]) -> dict[str, set[str]]:
    """The item ids each system finished, systems in order of first appearance."""
    ids: dict[str, set[str]] = defaultdict(set)
    for item_id, system in by_key:
        ids[system].add(item_id)
    return ids


def coverage_groups(records: Sequence[dict[str, Any]]) -> list[tuple[list[str], list[str]]]:
    """(systems, common item ids) per coverage level: all systems first, then the systems that went further.

    Each group holds the systems that finished at least that many items, over the items they all finished;
    a group is listed only when it adds items to the previous one.
    """
    by_key = latest(records)
    ids_by_system = _ids_by_system(by_key)
    systems = list(ids_by_system)
    index = {item_id: record.get("index", 0) for (item_id, _), record in by_key.items()}
    groups: list[tuple[list[str], list[str]]] = []
    for level in sorted({len(ids) for ids in ids_by_system.values()}):
        chosen = [s for s in systems if len(ids_by_system[s]) >= level]
        common = set.intersection(*(ids_by_system[s] for s in chosen))
        if groups and len(common) <= len(groups[-1][1]):
            continue
        groups.append((chosen, sorted(common, key=lambda i: index[i])))
    return groups


def summarise(
    task: Task, records: Sequence[dict[str, Any]], systems: Sequence[str] | None = None
) -> tuple[list[Row], list[str]]:
    """Rows per system (all, or `systems`) over the items all of them finished, and those item ids."""
    by_key = latest(records)
    ids_by_system = _ids_by_system(by_key)
    if systems is None:
        systems = list(ids_by_system)
    common = sorted(
        set.intersection(*(ids_by_system[s] for s in systems)) if systems else set(),
        key=lambda i: by_key[(i, systems[0])]["index"],
    )
    rows: list[Row] = []
    for system in systems:
        chosen = [by_key[(i, system)] for i in common]
        accuracy: dict[str, tuple[int, int]] = {}
        for metric in task.metrics:
            if metric in task.instruction_metrics:
                flat = [v for r in chosen for v in r.get(metric) or []]  # an errored prompt adds none
                accuracy[metric] = (sum(flat), len(flat))
            else:
                accuracy[metric] = (sum(passed(r, metric) for r in chosen), len(chosen))
        ttfts = [r["ttft_s"] for r in chosen if r.get("ttft_s") is not None]
        rounds = sum(r.get("rounds") or 0 for r in chosen)
        wins: dict[str, int] = defaultdict(int)
        for r in chosen:
            for member, count in (r.get("wins") or {}).items():
                wins[member] += count
        rows.append(
            Row(
                system=system,
                n=len(chosen),
                accuracy=accuracy,
                mean_total_s=fmean(r.get("total_s") or 0.0 for r in chosen) if chosen else 0.0,
                mean_ttft_s=fmean(ttfts) if ttfts else None,
                mean_calls=fmean(r.get("member_calls") or 0 for r in chosen) if chosen else 0.0,
                calls_per_round=sum(r.get("member_calls") or 0 for r in chosen) / rounds if rounds else None,
                mean_tokens=fmean(r.get("tokens") or 0 for r in chosen) if chosen else 0.0,
                errors=sum(1 for r in chosen if r.get("error")),
                wins=dict(wins),
                at_limit=fmean(r.get("finish_reason") == "length" for r in chosen) if chosen else 0.0,
                looping=fmean(loops(r.get("output") or "") for r in chosen) if chosen else 0.0,
            )
        )
    return rows, common


def _pct(row: Row, metric: str) -> str:
    k, n = row.accuracy[metric]
    lo, hi = wilson(k, n)
    return f"{k / n:.1%} [{lo:.1%}, {hi:.1%}]" if n else "–"


def table(task: Task, rows: Sequence[Row]) -> str:
    """A markdown table: accuracy with 95 % CI, mean time, time to first token, member calls."""
    metric_heads = [m.replace("_acc", "").replace("_", " ") for m in task.metrics]
    head = [
        "system",
        "n",
        *metric_heads,
        "mean time (s)",
        "time to first token (s)",
        "member calls",
        "calls / round",
        "tokens",
        "hit limit",
        "loops",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        ttft = f"{row.mean_ttft_s:.2f}" if row.mean_ttft_s is not None else "–"
        cells = [
            f"`{row.system}`",
            str(row.n),
            *(_pct(row, m) for m in task.metrics),
            f"{row.mean_total_s:.2f}",
            ttft,
            f"{row.mean_calls:.1f}",
            f"{row.calls_per_round:.2f}" if row.calls_per_round is not None else "–",
            f"{row.mean_tokens:.0f}",
            f"{row.at_limit:.0%}",
            f"{row.looping:.0%}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mcnemar_p(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value from the two discordant counts."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / (1 << n)
    return min(1.0, 2 * tail)


@dataclass
class Paired:
    """System `a` against `b` on the same items, by the task's primary metric."""

    a: str
    b: str
    n: int
    only_a: int  # items a got right and b wrong
    only_b: int

    @property
    def difference(self) -> float:
        return (self.only_a - self.only_b) / self.n if self.n else 0.0

    @property
    def p_value(self) -> float:
        return mcnemar_p(self.only_a, self.only_b)


def paired(
    task: Task, by_key: Mapping[tuple[str, str], dict[str, Any]], common: Sequence[str], a: str, b: str
) -> Paired:
    """Item-by-item comparison of two systems on the common items (`by_key` from :func:`latest`)."""

    def right(item_id: str, system: str) -> bool:
        return passed(by_key[(item_id, system)], task.primary)

    only_a = sum(right(i, a) and not right(i, b) for i in common)
    only_b = sum(right(i, b) and not right(i, a) for i in common)
    return Paired(a, b, len(common), only_a, only_b)


def comparisons(task: Task, rows: Sequence[Row], records: Sequence[dict[str, Any]], common: Sequence[str]) -> str:
    """Markdown lines: every engine variant against the best member, `default`, plain `segfuse` and `rerank`."""
    names = [r.system for r in rows]
    members = [r for r in rows if r.system.startswith("member:")]
    best = max(members, key=lambda r: r.rate(task.primary)).system if members else None
    presets = [n for n in names if n != "rerank" and not n.startswith("member:")]
    by_key = latest(records)
    lines: list[str] = []
    for a in presets:
        for b in dict.fromkeys(x for x in (best, "default", "specfuse", "rerank") if x in names and x != a):
            c = paired(task, by_key, common, a, b)
            lines.append(f"| `{a}` | `{b}` | {c.difference:+.1%} | {c.only_a} | {c.only_b} | {c.p_value:.3f} |")
    if not lines:
        return ""
    head = [
        f"Paired on the same items ({task.primary}): difference a − b, items only a got right, "
        "items only b got right, exact McNemar p.",
        "",
        "| a | b | a − b | only a | only b | p |",
        "|---|---|---|---|---|---|",
    ]
    return "\n".join(head + lines)


def plot(task: Task, rows: Sequence[Row], out_dir: Path, suffix: str = "") -> list[Path]:
    """Accuracy vs. mean time per system, and the share of segments won per member (files `<task><suffix>_*.png`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    written: list[Path] = []
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for row in rows:
        k, n = row.accuracy[task.primary]
        lo, hi = wilson(k, n)
        rate = row.rate(task.primary)
        ax.errorbar(row.mean_total_s, rate, yerr=[[rate - lo], [hi - rate]], fmt="o", capsize=4, label=row.system)
    ax.legend(fontsize=8, loc="best")  # a legend, not labels: fast members sit on top of each other
    ax.set_xlabel("mean time per answer (s)")
    ax.set_ylabel(f"{task.primary} (95% CI)")
    ax.set_title(f"{task.name}: accuracy vs. time (n={rows[0].n if rows else 0})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / f"{task.name}{suffix}_accuracy_vs_time.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    fused = [r for r in rows if r.wins and r.system != "rerank" and not r.system.startswith("member:")]
    if fused:
        members = sorted({m for r in fused for m in r.wins})
        fig, ax = plt.subplots(figsize=(6.4, 1.2 + 0.6 * len(fused)))
        for y, row in enumerate(fused):
            total = sum(row.wins.values()) or 1
            left = 0.0
            for i, member in enumerate(members):
                share = row.wins.get(member, 0) / total
                ax.barh(y, share, left=left, color=f"C{i}", label=member if y == 0 else None)
                if share > 0.06:
                    ax.text(left + share / 2, y, f"{share:.0%}", ha="center", va="center", fontsize=8)
                left += share
        ax.set_yticks(range(len(fused)), [r.system for r in fused])
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of segments won")
        ax.set_title(f"{task.name}: who wrote the fused answers", pad=24)
        ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.12), ncol=len(members), frameon=False)
        fig.tight_layout()
        path = out_dir / f"{task.name}{suffix}_segment_wins.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def build_report(out_dir: str | Path) -> Path:
    """Rebuild DIR/report.md and the PNG plots from DIR/<task>.jsonl files."""
    folder = Path(out_dir)
    files = [folder / f"{name}.jsonl" for name in TASKS if (folder / f"{name}.jsonl").is_file()]
    if not files:
        raise InvalidRequestError(f"no results in {folder}", "run `segfuse eval TASK --out DIR` first")
    parts = [f"# Evaluation report ({folder})", ""]
    for path in files:
        task = TASKS[path.stem]
        records = read_records(path)
        for number, (systems, _) in enumerate(coverage_groups(records)):
            rows, common = summarise(task, records, systems)
            if not rows:
                continue
            parts += _section(task, rows, records, common, folder, first=number == 0)
    report = folder / "report.md"
    report.write_text("\n".join(parts), encoding="utf-8")
    return report


def _section(
    task: Task,
    rows: Sequence[Row],
    records: Sequence[dict[str, Any]],
    common: Sequence[str],
    folder: Path,
    *,
    first: bool,
) -> list[str]:
    """Markdown for one task and one group of systems: heading, table, wins, paired tests, plots."""
    if first:
        heading = f"## {task.name}"
        scope = (
            f"{len(common)} items finished by every system (ids {common[0]} … {common[-1]})."
            if common
            else "No item finished by every system yet."
        )
    else:
        heading = f"### {task.name}: the systems that finished {len(common)} items"
        scope = (
            f"{len(common)} items (ids {common[0]} … {common[-1]}) finished by "
            + ", ".join(f"`{r.system}`" for r in rows)
            + "."
        )
    images = plot(task, rows, folder, suffix="" if first else f"_n{len(common)}")
    parts = [heading, "", scope, "", table(task, rows), ""]
    for row in rows:
        if row.wins and not row.system.startswith("member:"):
            total = sum(row.wins.values()) or 1
            unit = "answers" if row.system == "rerank" else "segments"
            shares = ", ".join(f"{m} {c / total:.0%}" for m, c in sorted(row.wins.items()))
            parts.append(f"- `{row.system}` {unit} won: {shares}")
    parts += [
        f"- `{row.system}`: {row.errors} items failed (recorded with `error`, counted wrong)"
        for row in rows
        if row.errors
    ]
    versus = comparisons(task, rows, records, common)
    if versus:
        parts += ["", versus]
    return parts + [""] + [f"![{p.stem}]({p.name})" for p in images] + [""]
