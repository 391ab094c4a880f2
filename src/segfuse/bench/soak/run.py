"""The soak: the real server under a long run of mixed traffic; nothing may be lost, nothing may leak.

``segfuse bench soak DURATION`` starts ``segfuse serve`` on loopback
(a small context window, so that prompts near it are cheap; a small queue, so
that bursts pass it) and sends it the seeded mix of ``traffic.py`` with the real
``openai`` client, phase after phase, until DURATION is spent or the request cap
is reached (the phase under way finishes). After every cycle's burst it waits
for the server to go idle and checks that no slot or KV-cache cell is held, reads
its resident memory and sends the probe. With ``remote`` the members are
``llama_cpp.server`` processes, and the first one's is killed at 30 % of the run
and started again, on the same port, at 40 %.

At the end it sets what the client saw against ``/health`` and ``/metrics``
(``accounting.py``) and writes a JSON record; ``report.py`` prints and plots it.
"""

from __future__ import annotations

import itertools
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...errors import SegfuseError
from ..common.machine import alive, loadavg, report_start, rss_mb, tree_pids, tree_rss_mb, write_report
from ..common.processes import MemberServer, SegfuseServer, segfuse_server, sigterm_as_interrupt
from ..ray.serving import NODE_IP as RAY_NODE_IP
from ..serve.serving import REMOTE_MODELS, check_config
from .accounting import (
    Check,
    Memory,
    Record,
    by_kind,
    delta,
    latency_tenths,
    parse_metrics,
    reconcile,
    tally,
    targets,
)
from .client import SoakClient
from .traffic import NORMAL, Action, Mix, Phase, plan, probe, warmup

MAX_BODY_BYTES = 65_536
WARM_FRACTION = 0.1  # memory "after warm-up": the first idle checkpoint past this share of the run
IDLE_TIMEOUT_S = 180.0  # for the server to finish what abandoned clients left behind
Log = Callable[[str], None]


@dataclass(frozen=True)
class SoakSettings:
    """What a soak run is asked to do."""

    duration_s: float
    seed: int = 0
    max_tokens: int = 16
    max_requests: int | None = None  # default: 10 per second of the run (time binds first)
    models: tuple[str, ...] = ()
    threads: int | None = None
    max_concurrent: int = 4
    queue_size: int = 8  # above the most in flight (8) less max_concurrent, so that only bursts get 429
    n_ctx: int = 512
    remote: bool = False
    ray: bool = False  # `segfuse serve --ray` (a local Ray instance on one node) instead of `segfuse serve`
    replicas: int = 1  # its front-end replicas
    cache_dir: str | None = None
    request_timeout_s: float = 300.0
    sample_s: float | None = None  # default: the run / 300, at least 2 s

    @property
    def mix(self) -> Mix:
        return Mix(seed=self.seed, max_tokens=self.max_tokens, burst=self.queue_size + self.max_concurrent + 4)

    @property
    def request_cap(self) -> int:
        return self.max_requests or max(50, int(self.duration_s * 10))

    @property
    def sample_every_s(self) -> float:
        return self.sample_s or max(2.0, self.duration_s / 300)

    def validate(self) -> None:
        if self.duration_s <= 0 or self.max_tokens < 1 or self.max_concurrent < 1 or self.queue_size < 1:
            raise SegfuseError("the soak needs a positive duration, --max-tokens, max_concurrent and queue size")
        if self.ray and self.remote:
            raise SegfuseError("--ray runs the members as Ray copies", "leave out --remote with --ray")
        if self.remote and self.models:
            raise SegfuseError("--remote starts its own members", "leave out -m/--model with --remote")
        if self.n_ctx < 256:
            raise SegfuseError(f"n_ctx {self.n_ctx} is too small for the soak's prompts", "use at least 256")

    def server_config(self, members: list[str], api_key: str) -> dict[str, dict[str, Any]]:
        config: dict[str, dict[str, Any]] = {
            "server": {
                "api_key": api_key,
                "max_concurrent": self.max_concurrent,
                "queue_size": self.queue_size,
                "max_body_bytes": MAX_BODY_BYTES,
            },
            "members": {
                "models": members or None,
                "threads": self.threads,
                "n_ctx": self.n_ctx,
                "cache_dir": self.cache_dir,
            },
            "defaults": {"max_tokens": self.max_tokens},
        }
        if self.ray:
            config["ray"] = {"replicas": self.replicas, "node_ip": RAY_NODE_IP}
        return config


class Soak:
    """One run against a started server: the traffic, the checkpoints, the samples."""

    def __init__(
        self, server: SegfuseServer, settings: SoakSettings, log: Log, disrupt: MemberServer | None = None
    ) -> None:
        self.server, self.settings, self.log, self.disrupt = server, settings, log, disrupt
        self.t0 = time.monotonic()
        self.client = SoakClient(
            server.url,
            server.api_key,
            n_ctx=settings.n_ctx,
            max_body_bytes=MAX_BODY_BYTES,
            t0=self.t0,
            request_timeout_s=settings.request_timeout_s,
        )
        self.records: list[Record] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._extra = itertools.count(1 << 40)  # indices of probes and warm-ups, apart from the plan's

    def now(self) -> float:
        return time.monotonic() - self.t0

    def rss(self) -> float | None:
        """The server's resident memory: its process's, or on Ray its whole tree's (copies, front ends, Ray)."""
        pid = self.server.process.pid
        return tree_rss_mb(pid) if self.settings.ray else rss_mb(pid)

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        before = self._counters(), self._metrics()
        start_rss = self.rss()
        with self._background(self._sample, "soak-sampler"), self._background(self._disrupt, "soak-disrupt"):
            self._warm_up()
            self._traffic()
            self._stop.set()
        end = self._checkpoint("end", send_probe=False)
        after = self._counters(), self._metrics()
        self.client.close()
        return {**self._result(before, after, start_rss, end), "log_errors": log_errors(self.server.log)}

    def _warm_up(self) -> None:
        for _ in range(2):
            self.records.append(self.client.send(warmup(next(self._extra), self.settings.mix)))
        self._checkpoint("warm-up")

    def _traffic(self) -> None:
        s = self.settings
        for phase in plan(s.mix):
            if self.now() >= s.duration_s or len(self.records) >= s.request_cap:
                break
            self._phase(phase)
            if phase.kind == "burst":
                self._checkpoint(f"cycle {phase.cycle + 1}")
            self.log(
                f"   {self.now():7.1f} s  phase {phase.index} ({phase.kind}, {phase.concurrency} in flight): "
                f"{len(self.records)} requests so far"
            )

    def _phase(self, phase: Phase) -> None:
        pool = ThreadPoolExecutor(phase.concurrency, thread_name_prefix=f"soak-p{phase.index}")
        try:
            futures = {pool.submit(self.client.send, a): a for a in phase.actions}
            done, _ = wait(futures, timeout=self.settings.request_timeout_s + 60)
            for future, action in futures.items():
                self.records.append(future.result() if future in done else self._lost(action))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if self.server.process.poll() is not None:
            raise SegfuseError(
                f"the server exited with status {self.server.process.returncode} during the soak:\n"
                f"{self.server.log_tail()}",
                f"see {self.server.log}",
            )

    def _lost(self, action: Action) -> Record:
        waited = self.settings.request_timeout_s + 60
        return Record.of(action, self.now(), waited, "lost", (), detail="no answer before the run's deadline")

    # ------------------------------------------------------------------ idle checkpoints

    def _checkpoint(self, label: str, send_probe: bool = True) -> dict[str, Any]:
        """Wait for the server to go idle; note what it holds, its memory; then send the probe."""
        t_wait = time.monotonic()
        # With nothing in flight, /health's view was read after the last request let its slots go.
        health = self._poll(lambda h: not h["queue"]["waiting"] and not h["queue"]["running"], IDLE_TIMEOUT_S)
        entry = {
            "t_s": self.now(),
            "label": label,
            "idle_wait_s": time.monotonic() - t_wait,
            "waiting": health["queue"]["waiting"],
            "running": health["queue"]["running"],
            "accepted": health["counters"]["accepted"],
            "occupancy": health.get("occupancy", {}),
            "held": held(health),
            "cached_cells": cached(health),
            "rss_mb": self.rss(),
        }
        if send_probe:
            record = self.client.send(probe(next(self._extra), self.settings.mix))
            self.records.append(record)
            entry["probe_latency_s"] = record.latency_s
        self.checkpoints.append(entry)
        self.log(
            f"   {entry['t_s']:7.1f} s  idle checkpoint {label}: RSS {entry['rss_mb']:.0f} MiB, "
            f"held: {', '.join(entry['held']) or 'nothing'}; cached: {entry['cached_cells']} cells"
        )
        return entry

    def _poll(self, ok: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        health = self.server.health()
        while not ok(health) and time.monotonic() < deadline:
            time.sleep(0.2)
            health = self.server.health()
        return health

    # ------------------------------------------------------------------ in the background

    @contextmanager
    def _background(self, target: Callable[[], None], name: str) -> Iterator[None]:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join(120)

    def _sample(self) -> None:
        while not self._stop.wait(self.settings.sample_every_s):
            try:
                health = self.server.health()
            except Exception:  # a busy moment: skip this sample
                continue
            cells = [o.get("cache_cells") or 0 for o in health.get("occupancy", {}).values()]
            self.samples.append(
                {
                    "t_s": self.now(),
                    "rss_mb": self.rss(),
                    "waiting": health["queue"]["waiting"],
                    "running": health["queue"]["running"],
                    "accepted": health["counters"]["accepted"],
                    "cache_cells": sum(cells),
                }
            )

    def _disrupt(self) -> None:
        """Kill the member server at 30 % of the run, start it again at 40 %."""
        target = self.disrupt
        if target is None:
            return
        for at, what in ((0.3, "killed"), (0.4, "restarted")):
            if self._stop.wait(max(0.0, at * self.settings.duration_s - self.now())):
                return
            target.kill() if what == "killed" else target.start()
            self.events.append({"t_s": self.now(), "event": f"{target.name} {what}"})
            self.log(f"   {self.now():7.1f} s  member server {target.name} {what}")

    # ------------------------------------------------------------------ reading the server

    def _counters(self) -> dict[str, int]:
        return dict(self.server.health()["counters"])

    def _metrics(self) -> dict[str, float]:
        import httpx

        # With the key: a server with one may keep /metrics (the prefix-cache figures) to its holders.
        response = httpx.get(
            f"{self.server.url}/metrics", timeout=30, headers={"Authorization": f"Bearer {self.server.api_key}"}
        )
        response.raise_for_status()
        return parse_metrics(response.text)

    def _result(
        self,
        before: tuple[dict[str, Any], dict[str, Any]],
        after: tuple[dict[str, Any], dict[str, Any]],
        start_rss: float | None,
        end: dict[str, Any],
    ) -> dict[str, Any]:
        warm = next(
            (c for c in self.checkpoints if c["t_s"] >= WARM_FRACTION * self.settings.duration_s and c is not end),
            self.checkpoints[0],
        )
        memory = Memory(
            start_rss,
            warm["rss_mb"],
            end["rss_mb"],
            end["accepted"] - warm["accepted"],
            [(s["t_s"], s["rss_mb"]) for s in self.samples if s["rss_mb"] is not None],
        )
        return {
            "wall_s": self.now(),
            "counters": {"before": before[0], "after": after[0]},
            "counters_delta": delta(before[0], after[0]),
            "metrics_delta": delta(before[1], after[1]),
            "memory": memory,
            "warm_checkpoint": warm["label"],
            "checkpoints": self.checkpoints,
            "samples": self.samples,
            "events": self.events,
            "records": self.records,
            "idle": {"waiting": end["waiting"], "running": end["running"]},
        }


ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAY_PREFIX = re.compile(r"^\([^)]* pid=\d+(?:, ip=[^)]*)?\) ")


def log_errors(path: Path, keep: int = 5) -> dict[str, Any]:
    """Tracebacks and ERROR lines in the server's log: how many, and the first few."""
    text = path.read_text(errors="replace") if path.exists() else ""
    # Ray prefixes a worker's lines with its colour and name, "(ServeReplica:... pid=N) ": read past them.
    lines = [RAY_PREFIX.sub("", line) for line in ANSI.sub("", text).splitlines()]
    found = [i for i, line in enumerate(lines) if line.startswith("Traceback") or " ERROR " in line]
    return {"count": len(found), "first": ["\n".join(lines[i : i + 12]) for i in found[:keep]]}


def held(health: dict[str, Any]) -> list[str]:
    """What members hold when idle that they should not, by /health's occupancy: a slot, a session's
    KV-cache cell, a stray cell (held by no session and no prefix-cache entry), or prefix-cache cells
    beyond its bound. Cached prefixes within the bound are kept on purpose, not leaked."""
    found = []
    for name, o in health.get("occupancy", {}).items():
        if o.get("slots") is not None and o.get("free_slots") is not None and o["free_slots"] != o["slots"]:
            found.append(f"{name}: {o['slots'] - o['free_slots']} slots")
        if o.get("cache_cells"):
            found.append(f"{name}: {o['cache_cells']} cells")
        if o.get("stray_cells"):
            found.append(f"{name}: {o['stray_cells']} stray cells")
        prefix = o.get("prefix") or {}
        if prefix.get("cells", 0) > prefix.get("bound", 0):
            found.append(f"{name}: {prefix['cells']} cached cells over the bound {prefix['bound']}")
    return found


def cached(health: dict[str, Any]) -> int:
    """Cells the members' prefix caches hold (kept on purpose, within their bounds)."""
    return sum((o.get("prefix") or {}).get("cells", 0) for o in health.get("occupancy", {}).values())


# --------------------------------------------------------------------------- the command


def run(
    settings: SoakSettings, out: Path | None = Path("runs/soak.json"), log: Log = print, startup_s: float = 600
) -> dict[str, Any]:
    """Start the server (and with ``remote`` its member servers), soak it, return the report and write
    it to `out` (JSON)."""
    import httpx  # noqa: F401  # before anything starts: fail at once when the client libraries are missing
    import openai  # noqa: F401  # likewise

    settings.validate()
    check_config(
        max_concurrent=settings.max_concurrent,
        queue_size=settings.queue_size,
        models=list(settings.models),
        threads=settings.threads,
        n_ctx=settings.n_ctx,
        cache_dir=settings.cache_dir,
    )
    report = report_start(
        {
            **asdict(settings),
            "request_cap": settings.request_cap,
            "burst": settings.mix.burst,
            "sample_every_s": settings.sample_every_s,
            "max_body_bytes": MAX_BODY_BYTES,
        }
    )
    raw = _soak(settings, report, out, log, startup_s)
    report["loadavg"]["end"] = loadavg()
    report.update(summarise(raw))
    _check_leftovers(report, log)
    return write_report(report, out)


def _soak(
    settings: SoakSettings, report: dict[str, Any], out: Path | None, log: Log, startup_s: float
) -> dict[str, Any]:
    """The members and the server started, the soak run against them, all stopped again; its raw data. The
    report gets the members, the server's processes and (beside `out`) its log."""
    import secrets

    with sigterm_as_interrupt(), ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="segfuse-soak-")))
        members, disrupt = _members(settings, workdir, stack, log)
        log(
            f"starting `segfuse serve{' --ray' if settings.ray else ''}` (max_concurrent {settings.max_concurrent}, "
            f"queue {settings.queue_size}, n_ctx {settings.n_ctx})…"
        )
        config = settings.server_config(members, secrets.token_hex(16))
        server = stack.enter_context(
            segfuse_server(workdir, "soak", config, startup_s=startup_s, extra_args=("--ray",) if settings.ray else ())
        )
        tree = tree_pids(server.process.pid)  # before the traffic: what the server started, Ray's workers too
        report["members"] = server.health()["members"]
        log(f"soaking {', '.join(report['members'])} for {settings.duration_s:.0f} s (seed {settings.seed})…")
        raw = Soak(server, settings, log, disrupt).run()
        report["processes"] = {"pids": sorted(set(tree) | set(tree_pids(server.process.pid)))}
        if out is not None:  # the server's log outlives its temporary folder, beside the report
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(server.log, Path(out).with_suffix(".server.log"))
            report["server_log"] = str(Path(out).with_suffix(".server.log"))
    return raw


def _check_leftovers(report: dict[str, Any], log: Log, wait_s: float = 30.0) -> None:
    """After the server stopped: which of its processes (on Ray, its instance and workers) still run; a check."""
    pids = report["processes"]["pids"]
    deadline = time.monotonic() + wait_s
    left = alive(pids)
    while left and time.monotonic() < deadline:  # Ray's workers end a few seconds after its raylet
        time.sleep(0.5)
        left = alive(left)
    report["processes"]["left"] = left
    if left:
        log(f"   {len(left)} of the server's {len(pids)} processes still run after it stopped: {left}")
    check = Check(
        "no process of the server left once it stopped",
        f"{len(pids)} processes",
        f"{len(left)} still running",
        not left,
    )
    report["checks"].append(asdict(check))
    report["all_checks_ok"] = report["all_checks_ok"] and check.ok


def _members(
    settings: SoakSettings, workdir: Path, stack: ExitStack, log: Log
) -> tuple[list[str], MemberServer | None]:
    """The member specs; with ``remote``, member servers started here, and the one to disrupt: the first
    (smollm2-135m, which leads, as remote members do not state their sizes)."""
    if not settings.remote:
        return list(settings.models), None
    from ...models import CATALOGUE, model_path

    members, servers = [], []
    for catalogue_name, member_name in REMOTE_MODELS:
        # Twice the window the soak's server believes in: its prompt-length estimate is approximate.
        served = MemberServer(
            model_path(CATALOGUE[catalogue_name], settings.cache_dir),
            workdir,
            catalogue_name,
            settings.threads,
            2 * settings.n_ctx,
        )
        log(f"starting llama_cpp.server for {catalogue_name}…")
        stack.callback(served.stop)
        served.start()
        servers.append(served)
        members.append(f"remote:{served.url}#{member_name}")
    return members, servers[0]


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """The checks, the outcomes, memory, latency and the targets of a run's raw data."""
    records: list[Record] = raw["records"]
    memory: Memory = raw["memory"]
    checks = reconcile(records, raw["counters_delta"], raw["metrics_delta"], raw["idle"])
    errors = raw["log_errors"]
    checks.append(
        Check("no error in the server's log", "", f"{errors['count']} tracebacks or ERROR lines", errors["count"] == 0)
    )
    bursts = [r for r in records if r.kind == "burst"]
    if bursts:
        rejected = sum(r.outcome == "rejected" for r in bursts)
        checks.append(
            Check(
                "bursts past the queue got 429", f"{rejected} of {len(bursts)} burst requests refused", "", rejected > 0
            )
        )
    held_when_idle = sum(1 for c in raw["checkpoints"] if c["held"] or c["waiting"] or c["running"])
    latency = latency_tenths(records, NORMAL)
    probes = [r.latency_s for r in records if r.kind == "probe" and r.outcome == "answered"]
    return {
        "wall_s": raw["wall_s"],
        "requests": len(records),
        "outcomes": tally(records),
        "by_kind": by_kind(records),
        "checks": [asdict(c) for c in checks],
        "all_checks_ok": all(c.ok for c in checks),
        "counters": raw["counters"],
        "counters_delta": raw["counters_delta"],
        "metrics_delta": {k: v for k, v in raw["metrics_delta"].items() if k.startswith("segfuse_") and v},
        "memory": memory.to_dict(),
        "memory_samples": memory.samples,
        "warm_checkpoint": raw["warm_checkpoint"],
        "checkpoints": raw["checkpoints"],
        "held_when_idle": held_when_idle,
        "latency": latency,
        "probe_latency_s": probes,
        "log_errors": errors,
        "events": raw["events"],
        "samples": raw["samples"],
        "targets": targets(records, memory, held_when_idle, latency["p95_ratio"]),
        "records": [asdict(r) for r in records],
    }


__all__ = ["MemberServer", "Soak", "SoakSettings", "held", "run", "summarise"]
