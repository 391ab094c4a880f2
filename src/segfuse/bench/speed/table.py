"""`segfuse bench`'s summary: the spreads of every row, the ratios of their medians, the printed tables (one
per system, its comparisons side by side) and the per-round plot.

Rows a run left out (the reference method, response level, RSS, the Hugging Face baseline of a llama.cpp
leader, the users) have no key in the report, no ratio and no column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...types import Result
from .systems import DEFAULT, PLAIN, spread

# ratio key -> (numerator row, denominator row): medians; present where both rows are
RATIOS: dict[str, tuple[str, str]] = {
    "fusion_tokens_per_s": ("fusion_tokens", "fusion"),
    "ratio_vs_floor": ("fusion", "floor"),
    "ratio_vs_members_sum": ("fusion", "members_sum"),
    "ratio_reference_over_fusion": ("reference_method", "fusion"),
    "ttfs_over_response_ttft": ("fusion_ttfs", "response_ttft"),
    "default_tokens_per_s": ("default_tokens", "default"),
    "default_over_leader_alone": ("default", "leader_alone"),
    "default_over_leader_generate": ("default", "leader_generate"),
    "fusion_users_throughput": ("fusion_one_by_one", "fusion_at_once"),
    "default_users_throughput": ("default_one_by_one", "default_at_once"),
}


def summary(rows: dict[str, list[float]]) -> dict[str, Any]:
    """Spreads of every row that has figures, and the ratios of medians (where both rows are)."""
    entry: dict[str, Any] = {k: spread(v) for k, v in rows.items() if v}
    med = {k: v["median"] for k, v in entry.items()}
    for key, (top, bottom) in RATIOS.items():
        if top in med and med.get(bottom):
            entry[key] = med[top] / med[bottom]
    return entry


@dataclass(frozen=True)
class Column:
    header: str
    needs: str  # the entry key the cell reads; the column is left out when no length has it
    cell: Callable[[dict[str, Any]], str]


def _s(row: str, digits: int = 1) -> Callable[[dict[str, Any]], str]:
    return lambda e: f"{e[row]['median']:.{digits}f} s"


def _x(key: str, digits: int = 2) -> Callable[[dict[str, Any]], str]:
    return lambda e: f"{e[key]:.{digits}f}"


def _tok_s(row: str, rate: str) -> Callable[[dict[str, Any]], str]:
    return lambda e: f"{e[row]['median']:.1f} s ({e[rate]:.1f} tok/s)"


def _columns(users: int) -> dict[str, list[Column]]:
    """Each system's columns: its time, first segment, comparisons, then the ratios side by side."""
    plain_times = {
        "floor": "floor",
        "members Σ": "members_sum",
        "reference": "reference_method",
        "response TTFT": "response_ttft",
    }
    plain_ratios = [
        ("vs floor", "ratio_vs_floor", 2),
        ("vs members Σ", "ratio_vs_members_sum", 2),
        ("reference / plain", "ratio_reference_over_fusion", 2),
        ("TTFS / response TTFT", "ttfs_over_response_ttft", 3),
        ("RSS ratio", "rss_ratio", 2),
    ]
    default_times = {"leader, own loop": "leader_alone", "leader, HF generate": "leader_generate"}
    default_ratios = [
        ("default / loop", "default_over_leader_alone", 2),
        ("default / generate", "default_over_leader_generate", 2),
    ]
    return {
        PLAIN: _system_columns(PLAIN, "fusion", plain_times, plain_ratios, users),
        DEFAULT: _system_columns(DEFAULT, "default", default_times, default_ratios, users),
    }


def _system_columns(
    system: str, row: str, times: dict[str, str], ratios: list[tuple[str, str, int]], users: int
) -> list[Column]:
    """A system's columns: its time (`row`) and rate, its first segment, the `times` it is compared with
    (header -> row), the `ratios` (header, key, digits), then its users."""
    return [
        Column(system, row, _tok_s(row, f"{row}_tokens_per_s")),
        Column("first segment", f"{row}_ttfs", _s(f"{row}_ttfs", 2)),
        *(Column(header, key, _s(key)) for header, key in times.items()),
        *(Column(header, key, _x(key, digits)) for header, key, digits in ratios),
        *_users_columns(row, users),
    ]


def _users_columns(prefix: str, users: int) -> list[Column]:
    return [
        Column(f"{users} one by one", f"{prefix}_one_by_one", _s(f"{prefix}_one_by_one")),
        Column(f"{users} at once", f"{prefix}_at_once", _s(f"{prefix}_at_once")),
        Column("throughput ×", f"{prefix}_users_throughput", _x(f"{prefix}_users_throughput")),
    ]


def tables(report: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(system, header, rows) per system: one row per answer length; "–" where a length lacks a figure."""
    entries = report["lengths"]
    out = []
    for system, columns in _columns(report.get("users") or 0).items():
        shown = [c for c in columns if any(c.needs in e for e in entries.values())]
        rows = [[length, *(c.cell(e) if c.needs in e else "–" for c in shown)] for length, e in entries.items()]
        out.append((system, ["tokens", *(c.header for c in shown)], rows))
    return out


def plot_rounds(result: Result, path: Path) -> Path:
    """Stacked bars per round: each member's draft and verify time, and the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = result.models
    rounds = result.rounds
    x = list(range(1, len(rounds) + 1))
    fig, ax = plt.subplots(figsize=(max(6, len(rounds) * 0.25), 4))
    bottom = [0.0] * len(rounds)
    colours = plt.get_cmap("tab10")
    for i, name in enumerate(names):
        for phase, attr, hatch in (("draft", "draft_s", ""), ("verify", "verify_s", "//")):
            heights = [getattr(r, attr).get(name, 0.0) for r in rounds]
            ax.bar(x, heights, bottom=bottom, color=colours(i), hatch=hatch, edgecolor="white", label=f"{name} {phase}")
            bottom = [b + h for b, h in zip(bottom, heights)]
    other = [max(0.0, r.total_s - b) for r, b in zip(rounds, bottom)]
    ax.bar(x, other, bottom=bottom, color="lightgrey", label="other (rank, broadcast, Python)")
    ax.set_xlabel("round")
    ax.set_ylabel("seconds")
    ax.set_title(f"Time per round, {result.stats.tokens}-token answer")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
