"""Serving benchmark: the real `specfuse serve` under concurrent users, serial vs. concurrent worker.

For each mode it starts the server in a subprocess on a free loopback port
(``python -m specfuse.cli serve --config TMP.toml --port P``), waits until
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

import json
import os
import platform
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .errors import SpecFuseError

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what a binary search does.",
    "List three fruits that are red.",
    "What is 17 plus 25?",
    "Give a one-line Python function that reverses a string.",
    "Why do cats purr? Answer briefly.",
    "Translate 'good morning' into Spanish.",
)
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


# --------------------------------------------------------------------------- subprocesses


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _parent_death_signal() -> Callable[[], None] | None:
    """Linux: a preexec_fn that makes the child get SIGTERM if this process dies without cleaning up
    (e.g. SIGKILL). libc is looked up here, in the parent: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return set_pdeathsig


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_until_serving(process: subprocess.Popen, url: str, timeout: float, log: Path,
                       ok: Callable[[Any], bool] = lambda r: r.status_code == 200) -> None:
    """Poll `url` until `ok(response)`; fail at once if `process` exits, or after `timeout` s."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise SpecFuseError(f"the server exited with status {process.returncode} while starting:\n{_tail(log)}",
                                f"see {log}")
        try:
            if ok(httpx.get(url, timeout=5)):
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SpecFuseError(f"the server did not become ready in {timeout:.0f} s:\n{_tail(log)}", f"see {log}")
        time.sleep(0.25)


def _stop(process: subprocess.Popen, first: int, grace: float) -> None:
    """`first` (uvicorn's graceful shutdown), again after `grace` s (uvicorn then exits at once), then SIGKILL."""
    for attempt in range(2):
        if process.poll() is not None:
            return
        try:
            process.send_signal(first)
            process.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
    process.kill()
    process.wait()


@contextmanager
def _process(args: list[str], log: Path, first_signal: int, grace: float) -> Iterator[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if k != "SPECFUSE_API_KEY"}
    with log.open("wb") as sink:  # a file, not a pipe: llama.cpp logs enough to fill a pipe and block
        process = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   preexec_fn=_parent_death_signal())
    try:
        yield process
    finally:
        _stop(process, first_signal, grace)


@dataclass
class Served:
    url: str  # base URL, no /v1
    api_key: str
    log: Path
    process: subprocess.Popen


def _toml_config(*, api_key: str, max_concurrent: int, queue_size: int, models: Sequence[str],
                 threads: int | None, n_ctx: int | None, cache_dir: str | None) -> str:
    q = json.dumps  # a JSON string is a valid TOML basic string
    lines = ["[server]", f"api_key = {q(api_key)}", f"max_concurrent = {max_concurrent}",
             f"queue_size = {queue_size}", "[members]"]
    if models:
        lines.append("models = [" + ", ".join(q(m) for m in models) + "]")
    if threads is not None:
        lines.append(f"threads = {threads}")
    if n_ctx is not None:
        lines.append(f"n_ctx = {n_ctx}")
    if cache_dir is not None:
        lines.append(f"cache_dir = {q(cache_dir)}")
    return "\n".join(lines) + "\n"


@contextmanager
def specfuse_server(workdir: Path, mode: str, *, max_concurrent: int, queue_size: int, models: Sequence[str],
                    threads: int | None, n_ctx: int | None, cache_dir: str | None,
                    startup_s: float) -> Iterator[Served]:
    """`python -m specfuse.cli serve` with a config written for this mode, until the block ends."""
    from .server.config import build_config

    api_key = secrets.token_hex(16)
    config = workdir / f"{mode}.toml"
    config.write_text(_toml_config(api_key=api_key, max_concurrent=max_concurrent, queue_size=queue_size,
                                   models=models, threads=threads, n_ctx=n_ctx, cache_dir=cache_dir))
    build_config(config)  # a bad setting fails here, before a subprocess is started
    port = free_port()
    log = workdir / f"{mode}.log"
    args = [sys.executable, "-m", "specfuse.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port)]
    # SIGINT: uvicorn's graceful shutdown, which closes the members (a second SIGINT cuts open requests short).
    with _process(args, log, signal.SIGINT, 20) as process:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(process, f"{url}/health", startup_s, log,
                           ok=lambda r: r.status_code == 200 and r.json().get("status") == "ok")
        yield Served(url, api_key, log, process)


@contextmanager
def llama_cpp_server(gguf: Path, log: Path, *, threads: int | None, n_ctx: int = 2048,
                     startup_s: float = 180) -> Iterator[str]:
    """`python -m llama_cpp.server` for one GGUF on a free loopback port; yields its /v1 URL."""
    port = free_port()
    args = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(n_ctx),
            # flash attention as in the local llama.cpp backend (the same numbers as local members)
            "--flash_attn", "true"]
    if threads is not None:
        args += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    with _process(args, log, signal.SIGTERM, 10) as process:
        url = f"http://127.0.0.1:{port}/v1"
        wait_until_serving(process, f"{url}/models", startup_s, log)
        yield url


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt (main thread only), so that the cleanup runs as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------- load


@dataclass
class Outcome:
    """One request: seconds from send to the end of the stream, to the first segment, tokens, error."""

    prompt: int
    latency_s: float
    ttfs_s: float | None
    completion_tokens: int | None
    finish_reason: str | None
    error: str | None = None


def one_request(client: Any, prompt_index: int, max_tokens: int) -> Outcome:
    t0 = time.perf_counter()
    ttfs = tokens = finish = None
    try:
        stream = client.chat.completions.create(
            model="specfuse", messages=[{"role": "user", "content": PROMPTS[prompt_index % len(PROMPTS)]}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                if ttfs is None and choice.delta is not None and choice.delta.content:
                    ttfs = time.perf_counter() - t0
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        error = None if tokens is not None else "the stream ended without usage"
    except Exception as exc:  # an error is a measurement, not the end of the benchmark
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    return Outcome(prompt_index % len(PROMPTS), time.perf_counter() - t0, ttfs, tokens, finish, error)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarise(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None]
    latencies = [o.latency_s for o in ok]
    ttfs = [o.ttfs_s for o in ok if o.ttfs_s is not None]
    tokens = sum(o.completion_tokens or 0 for o in ok)
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "errors": len(outcomes) - len(ok),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p95_s": percentile(latencies, 95),
        "latency_mean_s": statistics.fmean(latencies) if latencies else None,
        "ttfs_p50_s": percentile(ttfs, 50),
        "error_messages": sorted({o.error for o in outcomes if o.error}),
    }


def drive(server: Served, concurrency: int, requests: int, max_tokens: int, offset: int = 0) -> dict[str, Any]:
    """`requests` streamed completions, `concurrency` in flight at a time; the level's summary and raw data."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=900)
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix=f"bench-c{concurrency}")
    try:
        t0 = time.perf_counter()
        futures = [pool.submit(one_request, client, offset + i, max_tokens) for i in range(requests)]
        outcomes = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # on Ctrl-C: the server is stopped next, ending the rest
    client.close()
    if server.process.poll() is not None:
        raise SpecFuseError(f"the server exited with status {server.process.returncode} during the run:\n"
                            f"{_tail(server.log)}", f"see {server.log}")
    return {"concurrency": concurrency, **summarise(outcomes, wall), "outcomes": [asdict(o) for o in outcomes]}


# --------------------------------------------------------------------------- the benchmark


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(modes: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Ratios concurrent / serial per level, and the targets with their measured values."""
    serial, conc = modes.get("serial", {}).get("levels", {}), modes.get("concurrent", {}).get("levels", {})
    ratios: dict[str, dict[str, Any]] = {}
    for level in conc:
        if level not in serial:
            continue
        s, c = serial[level], conc[level]
        ratios[level] = {
            "throughput": _ratio(c["output_tokens_per_s"], s["output_tokens_per_s"]),
            "requests_per_s": _ratio(c["requests_per_s"], s["requests_per_s"]),
            "p50_latency": _ratio(c["latency_p50_s"], s["latency_p50_s"]),
            "p95_latency": _ratio(c["latency_p95_s"], s["latency_p95_s"]),
            "p50_ttfs": _ratio(c["ttfs_p50_s"], s["ttfs_p50_s"]),
        }
    measured = {
        "lone_latency_ratio": ratios.get("1", {}).get("p50_latency"),
        "latency_c4_over_lone": _ratio(conc.get("4", {}).get("latency_p50_s"), conc.get("1", {}).get("latency_p50_s")),
        "throughput_c4_ratio": ratios.get("4", {}).get("throughput"),
    }
    for name, mode in modes.items():  # the same latency ratio for each mode, for the record
        levels = mode["levels"]
        mode["latency_c4_over_lone"] = _ratio(levels.get("4", {}).get("latency_p50_s"),
                                              levels.get("1", {}).get("latency_p50_s"))
    targets = {}
    for key, (op, bound, what) in TARGETS.items():
        value = measured[key]
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        targets[key] = {"measured": value, "target": f"{op} {bound}", "met": met, "what": what}
    return ratios, targets


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    memory_gib = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory_gib, "platform": platform.platform(),
            "python": platform.python_version(), "hostname": platform.node()}


def _git() -> dict[str, Any] | None:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(dirty)} if commit else None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run(concurrency: Sequence[int] = DEFAULT_CONCURRENCY, requests: int | None = None, max_tokens: int = 32,
        models: Sequence[str] | None = None, threads: int | None = None, max_concurrent: int | None = None,
        remote: bool = False, out: Path | None = Path("runs/bench-serve.json"), n_ctx: int | None = None,
        cache_dir: str | None = None, warmup: int = 1, startup_s: float = 600,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run both modes at every level; write the report to `out` (JSON) and return it.

    `requests` per level defaults to max(8, 2 * concurrency). `threads` is llama.cpp's per member
    (default: the server's). With `remote`, `models` must be empty: the members are two
    llama_cpp.server processes started here (their threads: `threads`, else llama_cpp.server's default).
    """
    levels = sorted(set(int(c) for c in concurrency))
    if not levels or levels[0] < 1:
        raise SpecFuseError("concurrency levels must be positive integers", "e.g. --concurrency 1,2,4,8")
    if requests is not None and requests < 1:
        raise SpecFuseError("--requests must be at least 1")
    if max_tokens < 1:
        raise SpecFuseError("--max-tokens must be at least 1")
    if remote and models:
        raise SpecFuseError("--remote starts its own members", "leave out -m/--model with --remote")
    import httpx  # before anything starts: fail at once when the client libraries are missing
    import openai  # noqa: F401

    widest = max_concurrent or levels[-1]
    per_level = {c: requests or max(8, 2 * c) for c in levels}
    settings = {
        "concurrency": levels, "requests_per_level": {str(c): n for c, n in per_level.items()},
        "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "warmup_requests": warmup,
        "prompts": list(PROMPTS), "threads": threads, "threads_env": os.environ.get("SPECFUSE_THREADS"),
        "n_ctx": n_ctx, "remote": remote,
        "max_concurrent": {"serial": 1, "concurrent": widest},
        "queue_size": max(16, levels[-1]),
    }
    from .server.config import build_config

    for mc in (1, widest):  # a bad setting fails here, before anything is started
        build_config(None, max_concurrent=mc, queue_size=settings["queue_size"], models=list(models or []),
                     threads=threads, n_ctx=n_ctx, cache_dir=cache_dir)
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(), "git": _git(), "settings": settings, "loadavg": {"start": _loadavg()},
        "modes": {},
    }
    with _sigterm_as_interrupt(), ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specfuse-bench-serve-")))
        members = list(models or [])
        if remote:
            from .models import CATALOGUE, model_path

            for catalogue_name, member_name in REMOTE_MODELS:
                gguf = model_path(CATALOGUE[catalogue_name], cache_dir)
                log(f"starting llama_cpp.server for {catalogue_name}…")
                url = stack.enter_context(llama_cpp_server(gguf, workdir / f"{catalogue_name}.log", threads=threads))
                members.append(f"remote:{url}#{member_name}")
            settings["remote_servers"] = list(members)
        settings["members"] = members or "default"
        for mode in MODES:
            mc = 1 if mode == "serial" else widest
            log(f"== {mode}: starting `specfuse serve` with max_concurrent={mc}…")
            t0 = time.perf_counter()
            with specfuse_server(workdir, mode, max_concurrent=mc, queue_size=settings["queue_size"],
                                 models=members, threads=threads, n_ctx=n_ctx, cache_dir=cache_dir,
                                 startup_s=startup_s) as server:
                health = httpx.get(f"{server.url}/health", timeout=10).json()
                entry: dict[str, Any] = {"max_concurrent": mc, "members": health.get("members"),
                                         "startup_s": time.perf_counter() - t0, "levels": {}}
                if warmup:
                    warm = drive(server, 1, warmup, max_tokens, offset=len(PROMPTS) - 1)
                    entry["warmup"] = {k: v for k, v in warm.items() if k != "outcomes"}
                for c in levels:
                    log(f"   concurrency {c}: {per_level[c]} requests…")
                    level = drive(server, c, per_level[c], max_tokens)
                    entry["levels"][str(c)] = level
                    log(f"   concurrency {c}: {_fmt(level['requests_per_s'], '.2f')} req/s, "
                        f"{_fmt(level['output_tokens_per_s'], '.1f')} tok/s, "
                        f"p50 {_fmt(level['latency_p50_s'], '.2f')} s, errors {level['errors']}")
                entry["server_counters"] = httpx.get(f"{server.url}/health", timeout=10).json().get("counters")
            report["modes"][mode] = entry
    report["loadavg"]["end"] = _loadavg()
    report["ratios"], report["targets"] = compare(report["modes"])
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        report["out"] = str(out)
    return report


# --------------------------------------------------------------------------- printing


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


TABLE_HEADER = ["mode", "users", "requests", "errors", "req/s", "tok/s", "p50 latency", "p95 latency",
                "p50 first segment", "throughput ×", "p50 latency ×"]


def format_table(report: dict[str, Any]) -> list[list[str]]:
    """One row per mode and level; the × columns are concurrent / serial at the same level."""
    rows = []
    for mode, entry in report["modes"].items():
        for level, m in entry["levels"].items():
            r = report["ratios"].get(level, {}) if mode == "concurrent" else {}
            rows.append([
                f"{mode} ({entry['max_concurrent']})", level, str(m["requests"]), str(m["errors"]),
                _fmt(m["requests_per_s"], ".2f"), _fmt(m["output_tokens_per_s"], ".1f"),
                _fmt(m["latency_p50_s"], ".2f", " s"), _fmt(m["latency_p95_s"], ".2f", " s"),
                _fmt(m["ttfs_p50_s"], ".2f", " s"),
                _fmt(r.get("throughput"), ".2f", "×") if r else "",
                _fmt(r.get("p50_latency"), ".2f", "×") if r else "",
            ])
    return rows


def format_targets(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for key, t in report["targets"].items():
        met = "not measured" if t["met"] is None else ("✓" if t["met"] else "✗ (not met)")
        rows.append([t["what"], _fmt(t["measured"], ".2f", "×"), t["target"], met])
    return rows


def print_report(report: dict[str, Any], console: Any) -> None:
    """The results and the targets as rich tables."""
    from rich.table import Table

    members = report["modes"].get("serial", {}).get("members") or []
    table = Table(*TABLE_HEADER, title=f"SpecFuse serving benchmark ({', '.join(members)}; "
                  f"max_tokens {report['settings']['max_tokens']}, temperature 0, streaming)")
    for row in format_table(report):
        table.add_row(*row)
    console.print(table)
    targets = Table("check", "measured", "target", "", title="targets (reported, not enforced: the machine may be busy)")
    for row in format_targets(report):
        targets.add_row(*row)
    console.print(targets)
    load = report.get("loadavg", {})
    console.print(f"load average at start {load.get('start')}, at end {load.get('end')} "
                  f"({report['machine']['cores']} cores)", soft_wrap=True)


__all__ = ["PROMPTS", "TARGETS", "compare", "drive", "percentile", "print_report", "run", "summarise"]
