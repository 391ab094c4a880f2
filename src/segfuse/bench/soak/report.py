"""A soak's report for people: two short tables (rich) and a plot of memory and latency (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..serve.serving import fmt
from .accounting import CLIENT_OUTCOMES
from .duration import format_duration


def outcome_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Requests per kind and client outcome; columns of outcomes nobody had are left out."""
    kinds = report["by_kind"]
    columns = [o for o in CLIENT_OUTCOMES if any(row.get(o) for row in kinds.values())]
    rows = [
        [kind, str(sum(row.values()))] + [str(row.get(o, 0) or "") for o in columns]
        for kind, row in sorted(kinds.items(), key=lambda kv: -sum(kv[1].values()))
    ]
    total = report["outcomes"]
    rows.append(["all", str(report["requests"])] + [str(total.get(o, 0)) for o in columns])
    return ["kind", "sent", *columns], rows


def target_rows(report: dict[str, Any]) -> list[list[str]]:
    """Each target: what, measured, target, met."""
    rows = []
    for key, t in report["targets"].items():
        value = t["measured"]
        shown = (
            fmt(value * 100, "+.1f", " %")
            if key == "memory_growth" and value is not None
            else fmt(value, ".2f", "×")
            if key == "p95_drift"
            else str(value)
        )
        met = "not measured" if t["met"] is None else ("✓" if t["met"] else "✗ (not met)")
        op, bound = t["target"].split()
        target = f"{op} {float(bound) * 100:g} %" if key == "memory_growth" else t["target"]
        rows.append([t["what"], shown, target.replace("<=", "≤"), met])
    return rows


def summary_lines(report: dict[str, Any]) -> list[str]:
    m, lat = report["memory"], report["latency"]
    probes = report.get("probe_latency_s") or []
    return [
        f"server RSS: start {fmt(m['start_mb'], '.0f', ' MiB')}, after warm-up {fmt(m['warm_mb'], '.0f', ' MiB')} "
        f"({report['warm_checkpoint']}), end {fmt(m['end_mb'], '.0f', ' MiB')}: "
        f"{fmt(m['growth_per_1000_requests_mb'], '+.1f', ' MiB')} per 1,000 requests "
        f"({m['requests_since_warm']} accepted since warm-up)",
        _latency_line(lat),
        f"probe alone on the idle server: first {fmt(probes[0] if probes else None, '.2f', ' s')}, "
        f"last {fmt(probes[-1] if probes else None, '.2f', ' s')} ({len(probes)} probes)",
        f"idle checkpoints: {len(report['checkpoints'])}, with anything held: {report['held_when_idle']}; "
        f"events: {', '.join(e['event'] for e in report['events']) or 'none'}; member faults: {_faults(report)}",
    ]


def _faults(report: dict[str, Any]) -> str:
    """Members dropped from a request after a fault, by /metrics over the run."""
    prefix = "segfuse_member_faults_total{member="
    faults = {k[len(prefix) : -1]: int(v) for k, v in report["metrics_delta"].items() if k.startswith(prefix)}
    return ", ".join(f"{name} {n}" for name, n in faults.items()) or "none"


def _latency_line(lat: dict[str, Any]) -> str:
    if lat.get("first") is None:
        return f"latency drift: not measured ({lat.get('cycles', 0)} whole cycles; it takes 2)"

    def tenth(t: dict[str, Any]) -> str:
        cycles = f"cycle{'s' if len(t['cycles']) > 1 else ''} {', '.join(str(c + 1) for c in t['cycles'])}"
        return (
            f"{cycles}: p50 {fmt(t['p50_s'], '.2f', ' s')}, p95 {fmt(t['p95_s'], '.2f', ' s')} "
            f"({t['requests']} requests)"
        )

    return (
        f"latency of answered stream/complete/multi-turn requests, first tenth of {lat['cycles']} cycles "
        f"{tenth(lat['first'])}; last tenth {tenth(lat['last'])}"
    )


def print_report(report: dict[str, Any], console: Any) -> None:
    """The requests by kind and outcome, the failed checks, the targets, and a few lines of figures."""
    from rich.table import Table

    s = report["settings"]
    header, rows = outcome_rows(report)
    table = Table(
        *header,
        title=f"segfuse soak: {format_duration(report['wall_s'])} of traffic "
        f"({', '.join(report['members'])}; seed {s['seed']}, max_tokens {s['max_tokens']})",
    )
    for row in rows:
        table.add_row(*row)
    console.print(table)
    failed = [c for c in report["checks"] if not c["ok"]]
    if failed:
        checks = Table(
            "check", "client", "server", title=f"accounting: {len(failed)} of {len(report['checks'])} checks failed"
        )
        for c in failed:
            checks.add_row(c["name"], c["client"], c["server"])
        console.print(checks)
    else:
        console.print(f"accounting: all {len(report['checks'])} checks hold (client against /health and /metrics)")
    targets = Table("target", "measured", "target", "", title="targets (reported, not enforced)")
    for row in target_rows(report):
        targets.add_row(*row)
    console.print(targets)
    for line in summary_lines(report):
        console.print(line, soft_wrap=True)


def plot(report: dict[str, Any], path: Path) -> Path:
    """Resident memory and request latency over the run, in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, lat) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    samples = report["memory_samples"]
    mem.plot([t for t, _ in samples], [v for _, v in samples], lw=1, label="server RSS (sampled)")
    idle = [c for c in report["checkpoints"] if c.get("rss_mb") is not None]
    mem.scatter(
        [c["t_s"] for c in idle], [c["rss_mb"] for c in idle], s=14, color="C1", zorder=3, label="idle checkpoints"
    )
    mem.set_ylabel("MiB")
    mem.legend(loc="lower right", fontsize=8)
    records = report["records"]
    for kind, colour in (("stream", "C0"), ("complete", "C2"), ("multi_turn", "C4"), ("burst", "C7"), ("probe", "C3")):
        points = [(r["start_s"], r["latency_s"]) for r in records if r["kind"] == kind and r["outcome"] == "answered"]
        if points:
            lat.scatter(*zip(*points), s=8 if kind != "probe" else 20, color=colour, label=kind, alpha=0.7)
    for event in report["events"]:
        for axis in (mem, lat):
            axis.axvline(event["t_s"], color="k", ls=":", lw=1)
    for tenth in (report["latency"].get("first"), report["latency"].get("last")):
        if tenth:
            lat.axvspan(tenth["from_s"], tenth["to_s"], color="C1", alpha=0.08)
    lat.set_xlabel("seconds into the run")
    lat.set_ylabel("latency (s)")
    lat.legend(loc="upper left", fontsize=8, ncol=5)
    fig.suptitle("segfuse soak: memory and latency (shaded: the first and last tenth)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["outcome_rows", "plot", "print_report", "summary_lines", "target_rows"]
