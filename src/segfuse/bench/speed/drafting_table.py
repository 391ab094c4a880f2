"""The drafting benchmark's summary, per family, system and task (and all tasks together), and its table."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

ALL = "all"


def summarise(answers: list[dict[str, Any]], speed_reference: dict[str, str]) -> dict[str, Any]:
    """family -> system -> task (and "all") -> figures; tokens/s as the ratio of the sums (long answers weigh
    more), its ratio to the family's reference on the same prompts."""
    summary: dict[str, Any] = {}
    for family in sorted({a["family"] for a in answers}):
        mine = [a for a in answers if a["family"] == family]
        tasks = [*dict.fromkeys(a["task"] for a in mine), ALL]
        systems = [*dict.fromkeys(a["system"] for a in mine)]
        reference = speed_reference[family]
        summary[family] = {s: {t: cell(mine, s, t, reference) for t in tasks} for s in systems}
    return summary


def _pick(answers: Iterable[dict[str, Any]], system: str, task: str) -> list[dict[str, Any]]:
    return [a for a in answers if a["system"] == system and task in (ALL, a["task"])]


def tokens_per_s(rows: list[dict[str, Any]]) -> float:
    seconds = sum(r["seconds"] for r in rows)
    return sum(r["tokens"] for r in rows) / seconds if seconds > 0 else 0.0


def cell(answers: list[dict[str, Any]], system: str, task: str, reference: str) -> dict[str, Any]:
    rows = _pick(answers, system, task)
    speed, ref = tokens_per_s(rows), tokens_per_s(_pick(answers, reference, task))
    figures: dict[str, Any] = {
        "answers": len(rows),
        "tokens": sum(r["tokens"] for r in rows),
        "tokens_per_s": round(speed, 2),
        "ratio": round(speed / ref, 3) if ref else None,
    }
    if "identical" in rows[0]:
        figures["identical"] = sum(r["identical"] for r in rows)
        figures["parts_at"] = [r["parts_at"] for r in rows if not r["identical"]]
    drafted = sum(r.get("drafted_rounds", 0) for r in rows)
    if drafted:
        figures["accepted_per_drafted_round"] = round(sum(r["accepted"] for r in rows) / drafted, 2)
        figures["acceptance"] = acceptance(rows)
    return figures


def acceptance(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """drafter -> kept / proposed over the rows (with both counts)."""
    totals: dict[str, list[int]] = {}
    for row in rows:
        for drafter, d in row.get("drafting", {}).items():
            t = totals.setdefault(drafter, [0, 0])
            t[0], t[1] = t[0] + d["kept"], t[1] + d["proposed"]
    return {
        k: {"kept": kept, "proposed": prop, "rate": round(kept / prop, 3) if prop else None}
        for k, (kept, prop) in totals.items()
    }


HEADER = ("system", "task", "answers", "tok/s", "x alone", "kept/round", "acceptance", "same answer", "parts at")


def table_rows(summary: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per system and task, a family after another."""
    rows = []
    for systems in summary.values():
        for system, tasks in systems.items():
            for task, f in tasks.items():
                rows.append(row(system, task, f))
    return rows


def row(system: str, task: str, f: dict[str, Any]) -> tuple[str, ...]:
    rates = ", ".join(f"{k} {v['rate']:.2f}" for k, v in f.get("acceptance", {}).items() if v["rate"] is not None)
    same = f"{f['identical']}/{f['answers']}" if "identical" in f else "ref"
    parts = ",".join(str(p) for p in f.get("parts_at", [])[:6])
    kept = f.get("accepted_per_drafted_round")
    ratio = f"{f['ratio']:.2f}" if f["ratio"] is not None else "-"
    return (
        system,
        task,
        str(f["answers"]),
        f"{f['tokens_per_s']:.1f}",
        ratio,
        "-" if kept is None else f"{kept:.2f}",
        rates or "-",
        same,
        parts,
    )
