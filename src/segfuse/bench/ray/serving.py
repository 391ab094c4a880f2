"""Serving benchmark on Ray: `segfuse serve --ray` on one node beside `segfuse serve`, the same traffic.

Both servers run on loopback for the whole benchmark, with the same members, threads, context
window, slots and prefix cache:

- ``single``: `segfuse serve`, ``max_concurrent`` = the Ray side's ``max_concurrent x replicas``;
- ``ray``: `segfuse serve --ray` with a local Ray instance (node 127.0.0.2), one copy of each member
  (a Ray actor asking for as many CPUs as it runs threads) and ``replicas`` front-end replicas behind
  Serve's proxy.

Blocks take turns, single, ray, ray, single, ... (``reps`` pairs), so that a drift of the machine's
load falls on both alike; each block drives its server at every level (default 1 and 4 users) with
``requests`` streamed chat completions (``load.drive``). Per mode and level, over all of its blocks:
p50 and p95 latency per request, p50 time to the first content, output tokens/s, and the ratios
ray / single against the targets. Per block: the CPU seconds each server's processes spent, by role
(``process_cpu.py``: the copies, the front ends, Serve's proxy, Ray's own), the other server's while it
sat idle, and the copies' calls (``/health``). Then, with both servers stopped, what one call to a Ray
member costs against a local one (``calls.py``).
"""

from __future__ import annotations

import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ...errors import SegfuseError
from ..common.load import PROMPTS, Outcome, drive, ratio, summarise
from ..common.machine import loadavg, report_start, write_report
from ..common.processes import SegfuseServer, segfuse_server, sigterm_as_interrupt
from ..serve.serving import fmt, format_targets, level_row, print_load, print_targets, server_config
from .process_cpu import CpuMeter, spent

MODES = ("single", "ray")
NODE_IP = "127.0.0.2"  # the local Ray instance's node (never 127.0.0.1: Ray rewrites it)
# What `serve --ray` aims at on one node (docs/performance.md); measured and printed, never enforced.
TARGETS = {
    "latency": ("<=", 1.15, "p50 latency per request, ray / single"),
    "first_content": ("<=", 1.2, "p50 time to first content, ray / single"),
}
Log = Callable[[str], None]


def configs(
    *,
    max_concurrent: int,
    replicas: int,
    queue_size: int,
    models: Sequence[str],
    threads: int | None,
    n_ctx: int | None,
    cache_dir: str | None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Each mode's TOML sections: the single-process server as wide as the Ray side's replicas together."""
    members: dict[str, Any] = {"models": models, "threads": threads, "n_ctx": n_ctx, "cache_dir": cache_dir}
    single = server_config(max_concurrent=max_concurrent * replicas, queue_size=queue_size, **members)
    ray = server_config(max_concurrent=max_concurrent, queue_size=queue_size, **members)
    ray["ray"] = {"replicas": replicas, "node_ip": NODE_IP}
    return {"single": single, "ray": ray}


def block_order(reps: int) -> list[str]:
    """single, ray, ray, single, ... : `reps` pairs, each starting with the mode the last one ended with."""
    order: list[str] = []
    for i in range(reps):
        order += list(MODES) if i % 2 == 0 else list(reversed(MODES))
    return order


def copy_stats(server: SegfuseServer) -> dict[str, dict[str, int]]:
    """Each Ray member's copies' work so far (``/health``'s copies, summed per member); {} for a single process."""
    totals: dict[str, dict[str, int]] = {}
    for member, rows in (server.health().get("copies") or {}).items():
        into = totals.setdefault(member, {})
        for row in rows:
            for key, value in (row.get("stats") or {}).items():
                into[key] = into.get(key, 0) + int(value)
    return totals


def _stats_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {
        m: {k: v - before.get(m, {}).get(k, 0) for k, v in s.items() if v - before.get(m, {}).get(k, 0)}
        for m, s in after.items()
    }


def run_block(
    index: int,
    mode: str,
    servers: dict[str, SegfuseServer],
    meters: dict[str, CpuMeter],
    levels: Sequence[int],
    requests: int,
    max_tokens: int,
    log: Log,
) -> dict[str, Any]:
    """One block: `mode`'s server at every level; the CPU both servers' processes spent meanwhile."""
    server = servers[mode]
    cpu_before = {name: meter.read() for name, meter in meters.items()}
    calls_before = copy_stats(server)
    block: dict[str, Any] = {"index": index, "mode": mode, "levels": {}, "start": time.time()}
    for c in levels:
        level = drive(server, c, requests, max_tokens)
        block["levels"][str(c)] = level
        log(
            f"   block {index} ({mode}), {c} user{'s' if c > 1 else ''}: {level['output_tokens_per_s']:.1f} tok/s, "
            f"p50 {level['latency_p50_s']:.2f} s, first content {level['ttfs_p50_s'] or 0:.2f} s, "
            f"errors {level['errors']}"
        )
    block["copy_calls"] = _stats_delta(calls_before, copy_stats(server))
    block["cpu_s"] = {name: spent(cpu_before[name], meter.read()) for name, meter in meters.items()}
    return block


def pooled(blocks: Sequence[dict[str, Any]], mode: str, level: str) -> dict[str, Any]:
    """One mode's level over all of its blocks: every request's figures together, the wall times added."""
    mine = [b["levels"][level] for b in blocks if b["mode"] == mode]
    outcomes = [Outcome(**o) for lv in mine for o in lv["outcomes"]]
    entry = summarise(outcomes, sum(lv["wall_s"] for lv in mine))
    entry["per_block"] = {
        k: [lv[k] for lv in mine] for k in ("output_tokens_per_s", "latency_p50_s", "latency_p95_s", "ttfs_p50_s")
    }
    return entry


def compare(modes: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Ratios ray / single per level, and each target per level with its measured value."""
    ratios: dict[str, dict[str, Any]] = {}
    for level, r in modes["ray"].items():
        s = modes["single"][level]
        ratios[level] = {
            "p50_latency": ratio(r["latency_p50_s"], s["latency_p50_s"]),
            "p95_latency": ratio(r["latency_p95_s"], s["latency_p95_s"]),
            "p50_first_content": ratio(r["ttfs_p50_s"], s["ttfs_p50_s"]),
            "throughput": ratio(r["output_tokens_per_s"], s["output_tokens_per_s"]),
        }
    targets: dict[str, Any] = {}
    for level, r in ratios.items():
        for key, (op, bound, what) in TARGETS.items():
            value = r["p50_latency" if key == "latency" else "p50_first_content"]
            met = None if value is None else value <= bound
            targets[f"{key}_{level}"] = {
                "measured": value,
                "target": f"{op} {bound}",
                "met": met,
                "what": f"{what}, {level} user{'s' if level != '1' else ''}",
            }
    return ratios, targets


def cpu_per_request(blocks: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """CPU seconds per request each mode's processes spent, by role, over its own blocks."""
    out: dict[str, dict[str, float]] = {}
    for mode in MODES:
        mine = [b for b in blocks if b["mode"] == mode]
        n = sum(lv["requests"] for b in mine for lv in b["levels"].values())
        totals: dict[str, float] = {}
        for b in mine:
            for name, seconds in b["cpu_s"][mode].items():
                totals[name] = totals.get(name, 0.0) + seconds
        out[mode] = {name: round(s / n, 4) for name, s in sorted(totals.items(), key=lambda kv: -kv[1])} if n else {}
    return out


def start_servers(
    stack: ExitStack,
    workdir: Path,
    sections: dict[str, dict[str, dict[str, Any]]],
    report: dict[str, Any],
    *,
    max_tokens: int,
    startup_s: float,
    log: Log,
) -> dict[str, SegfuseServer]:
    """Both servers, up until `stack` closes, each warmed up by one request; their start in `report`."""
    servers: dict[str, SegfuseServer] = {}
    for mode in MODES:
        log(f"== starting `segfuse serve{' --ray' if mode == 'ray' else ''}`…")
        sections[mode]["server"]["api_key"] = secrets.token_hex(16)
        t0 = time.perf_counter()
        extra = ("--ray",) if mode == "ray" else ()
        servers[mode] = stack.enter_context(
            segfuse_server(workdir, mode, sections[mode], startup_s=startup_s, extra_args=extra)
        )
        health = servers[mode].health()
        report.setdefault("servers", {})[mode] = {
            "startup_s": time.perf_counter() - t0,
            "members": health.get("members"),
            "copies": health.get("copies"),
        }
        drive(servers[mode], 1, 1, max_tokens, offset=len(PROMPTS) - 1)  # warm-up
    return servers


def add_results(report: dict[str, Any], blocks: list[dict[str, Any]], levels: Sequence[int]) -> None:
    """The blocks into `report`, with each mode's pooled figures, the ratios, the targets and the CPU."""
    report["blocks"] = blocks
    report["modes"] = {mode: {str(c): pooled(blocks, mode, str(c)) for c in levels} for mode in MODES}
    report["ratios"], report["targets"] = compare(report["modes"])
    report["cpu_per_request_s"] = cpu_per_request(blocks)


def _check_arguments(levels: Sequence[int], *counts: int) -> list[int]:
    """The levels, sorted; a count that is not positive, or a missing client library, fails before anything
    starts."""
    ordered = sorted({int(c) for c in levels})
    if not ordered or ordered[0] < 1 or min(counts) < 1:
        raise SegfuseError("levels, --requests, --max-tokens, --reps and --replicas must be positive")
    import httpx  # noqa: F401  # imported to fail early
    import openai  # noqa: F401  # imported to fail early
    import ray  # noqa: F401  # imported to fail early

    return ordered


def run_blocks(
    servers: dict[str, SegfuseServer],
    order: Sequence[str],
    levels: Sequence[int],
    requests: int,
    max_tokens: int,
    log: Log,
) -> list[dict[str, Any]]:
    """Every block in `order`, each server's processes' CPU metered from the first."""
    meters = {mode: CpuMeter(server.process.pid) for mode, server in servers.items()}
    return [run_block(i, mode, servers, meters, levels, requests, max_tokens, log) for i, mode in enumerate(order)]


def run(
    levels: Sequence[int] = (1, 4),
    requests: int = 8,
    max_tokens: int = 32,
    reps: int = 2,
    models: Sequence[str] | None = None,
    threads: int | None = 1,
    max_concurrent: int = 4,
    replicas: int = 1,
    n_ctx: int | None = None,
    cache_dir: str | None = None,
    calls: bool = True,
    out: Path | None = Path("runs/bench-serve-ray.json"),
    startup_s: float = 600,
    log: Log = print,
) -> dict[str, Any]:
    """Both servers, `reps` pairs of blocks (module docstring); the report, written to `out` (JSON)."""
    levels = _check_arguments(levels, requests, max_tokens, reps, replicas)
    members: dict[str, Any] = {"models": list(models or []), "threads": threads, "n_ctx": n_ctx, "cache_dir": cache_dir}
    sections = configs(max_concurrent=max_concurrent, replicas=replicas, queue_size=max(16, levels[-1]), **members)
    settings: dict[str, Any] = {
        "levels": levels,
        "requests_per_level": requests,
        "max_tokens": max_tokens,
        "reps": reps,
        "order": block_order(reps),
        "threads": threads,
        "n_ctx": n_ctx,
        "replicas": replicas,
        "max_concurrent": {"single": max_concurrent * replicas, "ray": max_concurrent},
        "members": list(models or []) or "default",
        "prompts": list(PROMPTS),
        "temperature": 0.0,
        "stream": True,
    }
    report = report_start(settings)
    with sigterm_as_interrupt(), ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="segfuse-bench-ray-")))
        servers = start_servers(stack, workdir, sections, report, max_tokens=max_tokens, startup_s=startup_s, log=log)
        blocks = run_blocks(servers, settings["order"], levels, requests, max_tokens, log)
        for mode, server in servers.items():
            report["servers"][mode]["counters"] = server.health().get("counters")
    add_results(report, blocks, levels)
    report["loadavg"]["end"] = loadavg()
    if calls:
        from .calls import measure

        log("== one call to a Ray member against a local one…")
        report["member_calls"] = measure(threads=threads or 1, cache_dir=cache_dir)
    return write_report(report, out)


# --------------------------------------------------------------------------- printing


# as serving's: header -> (measure of a level, format, unit); ratio header -> (ray / single at a level, format)
LEVEL_COLUMNS = {
    "tok/s": ("output_tokens_per_s", ".1f", ""),
    "p50 latency": ("latency_p50_s", ".3f", " s"),
    "p95 latency": ("latency_p95_s", ".3f", " s"),
    "p50 first content": ("ttfs_p50_s", ".3f", " s"),
}
RATIO_COLUMNS = {
    "p50 latency ×": ("p50_latency", ".3f"),
    "first content ×": ("p50_first_content", ".3f"),
    "tok/s ×": ("throughput", ".3f"),
}
TABLE_HEADER = ["mode", "users", "requests", "errors", *LEVEL_COLUMNS, *RATIO_COLUMNS]


def format_table(report: dict[str, Any]) -> list[list[str]]:
    """One row per mode and level, over all of its blocks; the × columns are ray / single at the same level."""
    rows = []
    for mode, levels in report["modes"].items():
        for level, m in levels.items():
            r = report["ratios"][level] if mode == "ray" else {}
            rows.append(level_row(mode, level, m, r, LEVEL_COLUMNS, RATIO_COLUMNS))
    return rows


def format_cpu(report: dict[str, Any]) -> list[list[str]]:
    """CPU ms per request by role, each mode over its own blocks."""
    cpu = report["cpu_per_request_s"]
    roles = list(dict.fromkeys([*cpu["single"], *cpu["ray"]]))
    rows = [
        [
            name,
            fmt(1000 * cpu["single"][name], ".1f") if name in cpu["single"] else "",
            fmt(1000 * cpu["ray"][name], ".1f") if name in cpu["ray"] else "",
        ]
        for name in roles
    ]
    rows.append(["all", fmt(1000 * sum(cpu["single"].values()), ".1f"), fmt(1000 * sum(cpu["ray"].values()), ".1f")])
    return rows


def print_report(report: dict[str, Any], console: Any) -> None:
    """The results, the targets, CPU by process and the cost of one member call, as rich tables."""
    from rich.table import Table

    from .calls import format_rows

    s = report["settings"]
    table = Table(
        *TABLE_HEADER,
        title=f"`segfuse serve --ray` beside `segfuse serve` ({s['reps']} pairs of blocks, "
        f"{s['requests_per_level']} requests per level and block, max_tokens {s['max_tokens']}, "
        f"threads {s['threads']}, {s['replicas']} front-end replica(s))",
    )
    for row in format_table(report):
        table.add_row(*row)
    console.print(table)
    print_targets(format_targets(report, ".3f"), console)
    cpu = Table(
        "process",
        "single: CPU ms per request",
        "ray: CPU ms per request",
        title="where the CPU goes (user + system, each mode over its own blocks)",
    )
    for row in format_cpu(report):
        cpu.add_row(*row)
    console.print(cpu)
    if "member_calls" in report:
        calls = report["member_calls"]
        table = Table(
            "call",
            "Ray (ms)",
            "local (ms)",
            "Ray adds (ms)",
            "Ray / local",
            title=f"one call to {calls['model']} (median of {calls['n']}; the same values: {calls['same_values']})",
        )
        for row in format_rows(calls):
            table.add_row(*row)
        console.print(table)
    print_load(report, console)


__all__ = [
    "MODES",
    "TARGETS",
    "block_order",
    "compare",
    "configs",
    "copy_stats",
    "cpu_per_request",
    "pooled",
    "print_report",
    "run",
]
