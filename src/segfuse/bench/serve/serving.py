"""Serving benchmark: the real `segfuse serve` under concurrent users, serial vs. concurrent worker.

For each mode it starts the server in a subprocess on a free loopback port
(``python -m segfuse.cli serve --config TMP.toml --port P``), waits until
/health says ok, sends one warm-up request, then drives it with the real
``openai`` client, streaming, from a thread pool: for each concurrency level
C, ``requests`` chat completions (short varied prompts, fixed ``max_tokens``,
temperature 0) with C of them in flight at a time. Modes:

- ``serial``: ``max_concurrent = 1``, the worker runs one generation after another;
- ``concurrent``: ``max_concurrent = N`` (the largest level unless given): up to N
  generations in flight, their member work batched by the scheduler.

Both modes use the same members and threads. Per mode and level it measures
requests/s and output tokens/s (``usage.completion_tokens``, with
``stream_options.include_usage``) over the level's wall time, p50/p95 latency,
p50 time to first segment (the first chunk whose content is not empty) and
errors, and compares the concurrent mode with the serial one at the same level.

``remote=True`` starts two ``python -m llama_cpp.server`` (smollm2-135m and
qwen2.5-coder-0.5b) on loopback and makes them the members
(``remote:http://127.0.0.1:P/v1#name``); each serves one request at a time, so
what the concurrent mode wins there is overlap across members and requests. (Qwen's
member skips the echo check: llama-cpp-python shifts its prompt log-probs, see
REMOTE_MODELS; the timing is what counts here, not its votes.)

Every subprocess is stopped on the way out, also on Ctrl-C, SIGTERM or an error.
Targets are printed next to the measured values and never fail the run.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ...errors import SegfuseError
from ..common.load import PROMPTS, drive, ratio
from ..common.machine import loadavg, report_start, write_report
from ..common.processes import llama_cpp_server, segfuse_server, sigterm_as_interrupt

DEFAULT_CONCURRENCY = (1, 2, 4, 8)
MODES = ("serial", "concurrent")
# (catalogue model, member name and options). Qwen's prompts do not start with BOS, so llama-cpp-python's
# echoed prompt log-probs are shifted by one token (abetlen/llama-cpp-python#1983) and the remote member
# refuses the server unless told not to check: its verification scores are off, its work (what this
# benchmark times) is the same. The tests and docs/performance.md say so too.
REMOTE_MODELS = (("smollm2-135m", "smollm2-remote"), ("qwen2.5-coder-0.5b", "qwen-coder-remote,check_echo=false"))
# What the serving work aims at (docs/performance.md); measured and printed, never enforced.
TARGETS = {
    "lone_latency_ratio": ("<=", 1.05, "lone request p50 latency, concurrent / serial (concurrency 1)"),
    "latency_c4_over_lone": ("<=", 2.5, "p50 latency at concurrency 4 / lone request p50 latency (concurrent)"),
    "throughput_c4_ratio": (">=", 2.0, "output tokens/s at concurrency 4, concurrent / serial"),
}


# --------------------------------------------------------------------------- the benchmark


def server_config(
    *,
    max_concurrent: int,
    queue_size: int,
    models: Sequence[str],
    threads: int | None,
    n_ctx: int | None,
    cache_dir: str | None,
) -> dict[str, dict[str, Any]]:
    """The TOML sections of one mode's server, with a fresh API key."""
    return {
        "server": {"api_key": secrets.token_hex(16), "max_concurrent": max_concurrent, "queue_size": queue_size},
        "members": {"models": list(models) or None, "threads": threads, "n_ctx": n_ctx, "cache_dir": cache_dir},
    }


def compare(modes: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Ratios concurrent / serial per level, and the targets with their measured values."""
    serial, conc = modes.get("serial", {}).get("levels", {}), modes.get("concurrent", {}).get("levels", {})
    ratios: dict[str, dict[str, Any]] = {}
    for level in conc:
        if level not in serial:
            continue
        s, c = serial[level], conc[level]
        ratios[level] = {
            "throughput": ratio(c["output_tokens_per_s"], s["output_tokens_per_s"]),
            "requests_per_s": ratio(c["requests_per_s"], s["requests_per_s"]),
            "p50_latency": ratio(c["latency_p50_s"], s["latency_p50_s"]),
            "p95_latency": ratio(c["latency_p95_s"], s["latency_p95_s"]),
            "p50_ttfs": ratio(c["ttfs_p50_s"], s["ttfs_p50_s"]),
        }
    measured = {
        "lone_latency_ratio": ratios.get("1", {}).get("p50_latency"),
        "latency_c4_over_lone": ratio(conc.get("4", {}).get("latency_p50_s"), conc.get("1", {}).get("latency_p50_s")),
        "throughput_c4_ratio": ratios.get("4", {}).get("throughput"),
    }
    for mode in modes.values():  # the same latency ratio for each mode, for the record
        levels = mode["levels"]
        mode["latency_c4_over_lone"] = ratio(
            levels.get("4", {}).get("latency_p50_s"), levels.get("1", {}).get("latency_p50_s")
        )
    targets = {}
    for key, (op, bound, what) in TARGETS.items():
        value = measured[key]
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        targets[key] = {"measured": value, "target": f"{op} {bound}", "met": met, "what": what}
    return ratios, targets


def _remote_members(
    stack: ExitStack, workdir: Path, threads: int | None, cache_dir: str | None, log: Callable[[str], None]
) -> list[str]:
    """Start a llama_cpp.server per REMOTE_MODELS entry (stopped with `stack`); their member specs."""
    from ...models import CATALOGUE, model_path

    members = []
    for catalogue_name, member_name in REMOTE_MODELS:
        gguf = model_path(CATALOGUE[catalogue_name], cache_dir)
        log(f"starting llama_cpp.server for {catalogue_name}…")
        served = stack.enter_context(llama_cpp_server(gguf, workdir / f"{catalogue_name}.log", threads=threads))
        members.append(f"remote:{served.url}#{member_name}")
    return members


def _run_mode(
    workdir: Path,
    mode: str,
    config: dict[str, dict[str, Any]],
    levels: Sequence[int],
    per_level: dict[int, int],
    max_tokens: int,
    warmup: int,
    startup_s: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One server (serial or concurrent worker) driven at every concurrency level."""

    t0 = time.perf_counter()
    with segfuse_server(workdir, mode, config, startup_s=startup_s) as server:
        entry: dict[str, Any] = {
            "max_concurrent": config["server"]["max_concurrent"],
            "members": server.health().get("members"),
            "startup_s": time.perf_counter() - t0,
            "levels": {},
        }
        if warmup:
            warm = drive(server, 1, warmup, max_tokens, offset=len(PROMPTS) - 1)
            entry["warmup"] = {k: v for k, v in warm.items() if k != "outcomes"}
        for c in levels:
            log(f"   concurrency {c}: {per_level[c]} requests…")
            level = drive(server, c, per_level[c], max_tokens)
            entry["levels"][str(c)] = level
            log(
                f"   concurrency {c}: {fmt(level['requests_per_s'], '.2f')} req/s, "
                f"{fmt(level['output_tokens_per_s'], '.1f')} tok/s, "
                f"p50 {fmt(level['latency_p50_s'], '.2f')} s, errors {level['errors']}"
            )
        entry["server_counters"] = server.health().get("counters")  # with the key: counters are for key holders
    return entry


def _check_arguments(
    concurrency: Sequence[int], requests: int | None, max_tokens: int, remote: bool, models: Sequence[str] | None
) -> list[int]:
    """The concurrency levels, sorted; a bad argument or a missing client library fails before anything starts."""
    levels = sorted({int(c) for c in concurrency})
    if not levels or levels[0] < 1:
        raise SegfuseError("concurrency levels must be positive integers", "e.g. --concurrency 1,2,4,8")
    if requests is not None and requests < 1:
        raise SegfuseError("--requests must be at least 1")
    if max_tokens < 1:
        raise SegfuseError("--max-tokens must be at least 1")
    if remote and models:
        raise SegfuseError("--remote starts its own members", "leave out -m/--model with --remote")
    import httpx  # noqa: F401  # the client libraries: missing ones fail here, before any server starts
    import openai  # noqa: F401  # likewise

    return levels


def check_config(**sections: Any) -> None:
    """Build the configuration `server_config`'s settings make (as keywords): a bad setting fails here, before
    anything starts."""
    from ...config import build_config

    build_config(None, **sections)


def _settings(
    levels: list[int],
    per_level: dict[int, int],
    widest: int,
    common: dict[str, Any],
    *,
    max_tokens: int,
    warmup: int,
    remote: bool,
) -> dict[str, Any]:
    """What the report records of the run's settings (the members are added once they are known)."""
    return {
        "concurrency": levels,
        "requests_per_level": {str(c): n for c, n in per_level.items()},
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "warmup_requests": warmup,
        "prompts": list(PROMPTS),
        "threads": common["threads"],
        "threads_env": os.environ.get("SEGFUSE_THREADS"),
        "n_ctx": common["n_ctx"],
        "remote": remote,
        "max_concurrent": {"serial": 1, "concurrent": widest},
        "queue_size": common["queue_size"],
    }


def run(
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    requests: int | None = None,
    max_tokens: int = 32,
    models: Sequence[str] | None = None,
    threads: int | None = None,
    max_concurrent: int | None = None,
    remote: bool = False,
    out: Path | None = Path("runs/bench-serve.json"),
    n_ctx: int | None = None,
    cache_dir: str | None = None,
    warmup: int = 1,
    startup_s: float = 600,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run both modes at every level; write the report to `out` (JSON) and return it.

    `requests` per level defaults to max(8, 2 * concurrency). `threads` is llama.cpp's per member
    (default: the server's). With `remote`, `models` must be empty: the members are two
    llama_cpp.server processes started here (their threads: `threads`, else llama_cpp.server's default).
    """
    levels = _check_arguments(concurrency, requests, max_tokens, remote, models)
    widest = max_concurrent or levels[-1]
    per_level = {c: requests or max(8, 2 * c) for c in levels}
    common: dict[str, Any] = {
        "queue_size": max(16, levels[-1]),
        "threads": threads,
        "n_ctx": n_ctx,
        "cache_dir": cache_dir,
    }
    for mc in (1, widest):
        check_config(max_concurrent=mc, models=list(models or []), **common)
    settings = _settings(levels, per_level, widest, common, max_tokens=max_tokens, warmup=warmup, remote=remote)
    report = {**report_start(settings), "modes": {}}
    with sigterm_as_interrupt(), ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="segfuse-bench-serve-")))
        specs = list(models or [])
        if remote:
            specs += _remote_members(stack, workdir, threads, cache_dir, log)
            settings["remote_servers"] = list(specs)
        settings["members"] = specs or "default"
        for mode in MODES:
            mc = 1 if mode == "serial" else widest
            log(f"== {mode}: starting `segfuse serve` with max_concurrent={mc}…")
            config = server_config(max_concurrent=mc, models=specs, **common)
            report["modes"][mode] = _run_mode(
                workdir, mode, config, levels, per_level, max_tokens, warmup, startup_s, log
            )
    report["loadavg"]["end"] = loadavg()
    report["ratios"], report["targets"] = compare(report["modes"])
    return write_report(report, out)


# --------------------------------------------------------------------------- printing


def fmt(value: float | None, spec: str, unit: str = "") -> str:
    """`value` formatted by `spec` with `unit`, or a dash where there is none."""
    return "–" if value is None else f"{value:{spec}}{unit}"


# header -> (measure of a level, format, unit); ratio header -> (ratio of a level, format)
LEVEL_COLUMNS = {
    "req/s": ("requests_per_s", ".2f", ""),
    "tok/s": ("output_tokens_per_s", ".1f", ""),
    "p50 latency": ("latency_p50_s", ".2f", " s"),
    "p95 latency": ("latency_p95_s", ".2f", " s"),
    "p50 first segment": ("ttfs_p50_s", ".2f", " s"),
}
RATIO_COLUMNS = {"throughput ×": ("throughput", ".2f"), "p50 latency ×": ("p50_latency", ".2f")}
TABLE_HEADER = ["mode", "users", "requests", "errors", *LEVEL_COLUMNS, *RATIO_COLUMNS]


def format_table(report: dict[str, Any]) -> list[list[str]]:
    """One row per mode and level; the × columns are concurrent / serial at the same level."""
    rows = []
    for mode, entry in report["modes"].items():
        for level, m in entry["levels"].items():
            r = report["ratios"].get(level, {}) if mode == "concurrent" else {}
            rows.append(level_row(f"{mode} ({entry['max_concurrent']})", level, m, r, LEVEL_COLUMNS, RATIO_COLUMNS))
    return rows


def level_row(
    mode: str,
    level: str,
    measures: dict[str, Any],
    ratios: dict[str, Any],
    columns: dict[str, tuple[str, str, str]],
    ratio_columns: dict[str, tuple[str, str]],
) -> list[str]:
    """A table's row of one mode at one level: its requests and errors, its `columns`, then its `ratio_columns`
    (blank without `ratios`)."""
    return [
        mode,
        level,
        str(measures["requests"]),
        str(measures["errors"]),
        *(fmt(measures[key], spec, unit) for key, spec, unit in columns.values()),
        *(fmt(ratios.get(key), spec, "×") if ratios else "" for key, spec in ratio_columns.values()),
    ]


def format_targets(report: dict[str, Any], spec: str = ".2f") -> list[list[str]]:
    """One row per target: what, the measured ratio (`spec`), the target, whether it was met."""
    rows = []
    for t in report["targets"].values():
        met = "not measured" if t["met"] is None else ("✓" if t["met"] else "✗ (not met)")
        rows.append([t["what"], fmt(t["measured"], spec, "×"), t["target"].replace("<=", "≤"), met])
    return rows


def print_targets(rows: list[list[str]], console: Any) -> None:
    """The targets' rows (`format_targets`) as a rich table."""
    from rich.table import Table

    targets = Table(
        "check", "measured", "target", "", title="targets (reported, not enforced: the machine may be busy)"
    )
    for row in rows:
        targets.add_row(*row)
    console.print(targets)


def print_load(report: dict[str, Any], console: Any) -> None:
    """The load average the report noted at its start and end, beside the machine's cores."""
    load = report.get("loadavg", {})
    console.print(
        f"load average at start {load.get('start')}, at end {load.get('end')} ({report['machine']['cores']} cores)",
        soft_wrap=True,
    )


def print_report(report: dict[str, Any], console: Any) -> None:
    """The results and the targets as rich tables."""
    from rich.table import Table

    members = report["modes"].get("serial", {}).get("members") or []
    table = Table(
        *TABLE_HEADER,
        title=f"segfuse serving benchmark ({', '.join(members)}; "
        f"max_tokens {report['settings']['max_tokens']}, temperature 0, streaming)",
    )
    for row in format_table(report):
        table.add_row(*row)
    console.print(table)
    print_targets(format_targets(report), console)
    print_load(report, console)


__all__ = ["TARGETS", "compare", "print_report", "run"]
