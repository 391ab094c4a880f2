"""Many requests to two ensembles that share members, a few in flight: nothing fails, nothing loads twice.

``python -m segfuse.bench.ensembles.on_demand --requests 200 --in-flight 4`` starts `segfuse serve` with two
ensembles (``small`` = smollm2 + gemma3, preloaded; ``full`` = the three embedded models), sends the
requests alternating between them through the `openai` client, and prints (and writes as JSON) what
failed, each model's answer times, how often each member loaded, and the server's RSS before and after.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..common.processes import segfuse_server
from . import KEY, ask, command

SMALL = ["smollm2-135m", "gemma3-270m"]
FULL = ["qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"]


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


def run(requests: int, in_flight: int, max_tokens: int, workdir: Path) -> dict[str, Any]:
    config: dict[str, dict[str, Any]] = {
        "server": {"api_key": KEY, "max_concurrent": in_flight, "queue_size": 4 * in_flight},
        "members": {"threads": 1, "n_ctx": 1024},
        "defaults": {"max_tokens": max_tokens},
        "ensembles.small": {"members": SMALL},
        "ensembles.full": {"members": FULL},
    }
    with segfuse_server(workdir, "on-demand", config, startup_s=600) as server:
        before = rss_bytes(server.process.pid)
        models = ["small" if i % 2 == 0 else "full" for i in range(requests)]
        started = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as pool:
            answers = list(pool.map(lambda i: ask(server.api, models[i], max_tokens, i), range(requests)))
        wall = time.perf_counter() - started
        health = server.health()
        after = rss_bytes(server.process.pid)
    return summary(answers, health, wall, before, after, in_flight)


def summary(
    answers: list[dict[str, Any]], health: dict[str, Any], wall: float, before: int, after: int, in_flight: int
) -> dict[str, Any]:
    failed = [a for a in answers if a["error"]]
    by_model = {}
    for model in ("small", "full"):
        times = [a["seconds"] for a in answers if a["model"] == model and not a["error"]]
        by_model[model] = {"answers": len(times), "median_s": statistics.median(times) if times else None}
    loads = {name: place["loads"] for name, place in health["memory"].items()}
    return {
        "requests": len(answers),
        "in_flight": in_flight,
        "failed": len(failed),
        "first_failures": [a["error"] for a in failed[:3]],
        "wall_s": round(wall, 1),
        "models": by_model,
        "loads": loads,
        "loaded_twice": [name for name, count in loads.items() if count > 1],
        "server_failed_counter": health["counters"]["failed"],
        "rss_before_mib": round(before / 2**20),
        "rss_after_mib": round(after / 2**20),
    }


def main(argv: list[str] | None = None) -> int:
    return command(
        argv,
        __doc__ or "",
        run,
        8,
        "runs/on-demand.json",
        lambda result: result["failed"] == 0 and not result["loaded_twice"],
    )


if __name__ == "__main__":
    raise SystemExit(main())
