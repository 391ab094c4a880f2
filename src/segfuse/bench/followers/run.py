"""What the members the default never asks cost a server, measured side by side on one `segfuse serve`.

By default the leader answers alone (``accept_margin`` 0). Three systems answer
the same short prompts (``load.PROMPTS``), streamed, greedy, at each
concurrency level, taking turns level by level so that the machine's noise
falls on all of them alike:

- ``lazy``: the default; the other members stay on standby (they start only if
  the leader fails);
- ``eager``: ``followers="eager"``; the others read every prompt and follow
  every segment, as every request did before lazy followers;
- ``leader``: ``model=<leader>``, the leader as a model of its own.

The server's prefix cache is off here, so that every request pays for its own
prompt and no system warms the cache for the next. Reported, never enforced:
the lazy default's lone latency over the leader's (target <= 1.05x) and its
throughput at the widest level over the eager followers' (what they cost).
"""

from __future__ import annotations

import json
import secrets
import tempfile
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..common.load import drive
from ..common.machine import git, loadavg, machine
from ..common.processes import segfuse_server, sigterm_as_interrupt

SYSTEMS: dict[str, tuple[str | None, dict[str, Any] | None]] = {
    "lazy": (None, None),  # model None: the ensemble's own id
    "eager": (None, {"followers": "eager"}),
    "leader": ("leader", None),
}


def run(
    levels: Sequence[int] = (1, 4),
    requests: int = 8,
    max_tokens: int = 32,
    leader: str = "qwen2.5-coder-0.5b",
    models: Sequence[str] | None = None,
    threads: int | None = None,
    reps: int = 2,
    out: Path | None = Path("runs/bench-followers.json"),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every system at every level, `reps` times in turn; the report (also written to `out`)."""
    config: dict[str, dict[str, Any]] = {
        "server": {"api_key": secrets.token_hex(16), "max_concurrent": max(levels), "queue_size": 64},
        "members": {"models": list(models or []) or None, "threads": threads, "prefix_cache_cells": 0},
    }
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git(),
        "settings": {
            "levels": list(levels),
            "requests": requests,
            "max_tokens": max_tokens,
            "leader": leader,
            "reps": reps,
            "threads": threads,
            "members": list(models or []) or "default",
        },
        "loadavg": {"start": loadavg()},
        "runs": [],
    }
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="segfuse-bench-followers-") as tmp:
        with segfuse_server(Path(tmp), "followers", config) as server:
            drive(server, 1, 1, max_tokens)  # warm-up
            for rep in range(reps):
                for level in levels:
                    order = list(SYSTEMS) if rep % 2 == 0 else list(reversed(SYSTEMS))
                    for system in order:
                        report["runs"].append(_one(server, system, level, requests, max_tokens, leader, rep, log))
    report["loadavg"]["end"] = loadavg()
    report["summary"] = summarise(report["runs"], levels)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
        report["out"] = str(out)
    return report


def _one(
    server: Any,
    system: str,
    level: int,
    requests: int,
    max_tokens: int,
    leader: str,
    rep: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    model, options = SYSTEMS[system]
    result = drive(
        server, level, requests, max_tokens, model=leader if model == "leader" else "segfuse", options=options
    )
    log(
        f"   {system:6} x{level}: {result['output_tokens_per_s'] or 0:.1f} tok/s, "
        f"p50 {result['latency_p50_s'] or 0:.2f} s, errors {result['errors']}"
    )
    return {"system": system, "level": level, "rep": rep, **{k: v for k, v in result.items() if k != "outcomes"}}


def summarise(runs: Sequence[dict[str, Any]], levels: Sequence[int]) -> dict[str, Any]:
    """Per system and level: tokens/s over all repetitions' wall time, and the median of p50 latencies;
    then the two ratios that say what standby followers cost and save: one request's p50 latency with lazy
    followers over the leader alone's (at the lowest level), and tokens/s with lazy followers over eager ones
    (at the highest)."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for system in SYSTEMS:
        for level in levels:
            mine = [r for r in runs if r["system"] == system and r["level"] == level]
            tokens, wall = sum(r["output_tokens"] for r in mine), sum(r["wall_s"] for r in mine)
            p50s = sorted(r["latency_p50_s"] for r in mine if r["latency_p50_s"] is not None)
            table.setdefault(system, {})[str(level)] = {
                "tokens_per_s": tokens / wall if wall else 0.0,
                "latency_p50_s": p50s[len(p50s) // 2] if p50s else 0.0,
                "errors": sum(r["errors"] for r in mine),
            }
    low, high = str(min(levels)), str(max(levels))
    lone = table["lazy"][low]["latency_p50_s"] / (table["leader"][low]["latency_p50_s"] or float("nan"))
    gain = table["lazy"][high]["tokens_per_s"] / (table["eager"][high]["tokens_per_s"] or float("nan"))
    return {"systems": table, "lone_latency_lazy_over_leader": lone, f"throughput_x{high}_lazy_over_eager": gain}


def print_report(report: dict[str, Any], console: Any) -> None:
    """Per system and level: tokens/s and p50 latency; then the two ratios."""
    from rich.table import Table

    summary, settings = report["summary"], report["settings"]
    levels = [str(level) for level in settings["levels"]]
    table = Table(
        "system",
        *(f"x{level} tok/s, p50 s" for level in levels),
        title=f"What the followers cost (leader {settings['leader']}, max_tokens {settings['max_tokens']}, "
        f"{settings['requests']} requests per level, {settings['reps']} reps, no prefix cache)",
    )
    for system, row in summary["systems"].items():
        table.add_row(
            system,
            *(
                f"{row[level]['tokens_per_s']:.1f}, {row[level]['latency_p50_s']:.2f}"
                f"{' (errors ' + str(row[level]['errors']) + ')' if row[level]['errors'] else ''}"
                for level in levels
            ),
        )
    console.print(table)
    ratios = {k: v for k, v in summary.items() if k != "systems"}
    console.print(
        "; ".join(f"{k} {v:.3f}" for k, v in ratios.items()) + " (lone latency target <= 1.05)", soft_wrap=True
    )
