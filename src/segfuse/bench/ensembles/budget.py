"""A memory budget that fits two of three members, and requests alternating between two ensembles that
together need all three: the loaded bytes never pass the bound (first loads included), nothing fails.

``python -m segfuse.bench.ensembles.budget --requests 200 --in-flight 4`` (or ``segfuse bench ensembles
--budget``) starts `segfuse serve` with ``small`` (smollm2 + gemma3) and ``coder`` (smollm2 + qwen2.5-coder
0.5B), none preloaded, and ``max_loaded_bytes`` set to smollm2's estimated bytes plus the larger of the other
two's (so gemma3 and qwen must take turns); sends the requests alternating between the two through the
`openai` client while a thread reads ``/health`` every 100 ms; and prints (and writes as JSON) the most
bytes seen held, the bound, what failed or came back incomplete, and how often each member loaded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...backends.registry import estimate_bytes
from ...member_options import MemberOptions
from ..common.processes import SegfuseServer, segfuse_server
from . import KEY, ask, command

SHARED, TAKING_TURNS = "smollm2-135m", ("gemma3-270m", "qwen2.5-coder-0.5b")
ENSEMBLES = {"small": [SHARED, TAKING_TURNS[0]], "coder": [SHARED, TAKING_TURNS[1]]}
N_CTX = 1024
SAMPLE_S = 0.1


def config(in_flight: int) -> dict[str, dict[str, Any]]:
    """The server's settings: a byte budget of two of the three members, as the server will estimate them."""
    options = MemberOptions.build({"n_ctx": N_CTX, "threads": 1, "slots": in_flight})
    estimates = {name: estimate_bytes(name, options) for name in (SHARED, *TAKING_TURNS)}
    sizes = {name: size for name, size in estimates.items() if size is not None}
    if len(sizes) < len(estimates):
        raise RuntimeError(f"no size estimate for {estimates}: run `segfuse models prepare`")
    bound = sizes[SHARED] + max(sizes[n] for n in TAKING_TURNS) + 2**20  # any two, never all three
    settings: dict[str, dict[str, Any]] = {
        "server": {
            "api_key": KEY,
            "max_concurrent": in_flight,
            "queue_size": 4 * in_flight,
            "preload": [],
            "max_loaded_bytes": bound,
        },
        "members": {"threads": 1, "n_ctx": N_CTX},
    }
    settings |= {f"ensembles.{name}": {"members": members} for name, members in ENSEMBLES.items()}
    return settings


def held_bytes(memory: dict[str, Any]) -> int:
    """What the budget counts in /health's memory: members loading, loaded or closing, measured else estimated."""
    held = [m for m in memory.values() if m["state"] in ("loading", "loaded", "unloading")]
    return sum(m["bytes"] if m["bytes"] is not None else m["estimated_bytes"] or 0 for m in held)


@contextmanager
def sampling(server: SegfuseServer) -> Iterator[list[int]]:
    """/health's held bytes every ``SAMPLE_S`` in a thread while the block runs (the list of them)."""
    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_S):
            seen.append(held_bytes(server.health()["memory"]))

    thread = threading.Thread(target=sample, name="health-sampler", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join(10)


def drive(server: SegfuseServer, bound: int, requests: int, in_flight: int, max_tokens: int) -> dict[str, Any]:
    """The requests, alternating between the ensembles, `in_flight` at once, /health sampled meanwhile;
    `bound`: the server's max_loaded_bytes."""
    models = ["small" if i % 2 == 0 else "coder" for i in range(requests)]
    started = time.perf_counter()
    with sampling(server) as seen, ThreadPoolExecutor(in_flight) as pool:
        answers = list(pool.map(lambda i: ask(server.api, models[i], max_tokens, i), range(requests)))
    wall = time.perf_counter() - started
    health = server.health()
    failed = [a for a in answers if a["error"]]
    return {
        "requests": requests,
        "in_flight": in_flight,
        "max_tokens": max_tokens,
        "failed": len(failed),
        "first_failures": [a["error"] for a in failed[:3]],
        "wall_s": round(wall, 1),
        "bound_bytes": bound,
        "most_held_bytes": max(seen, default=0),
        "samples": len(seen),
        "loads": {name: m["loads"] for name, m in health["memory"].items()},
        "bytes": {name: m["bytes"] for name, m in health["memory"].items()},
        "estimated_bytes": {name: m["estimated_bytes"] for name, m in health["memory"].items()},
        "server_failed_counter": health["counters"]["failed"],
    }


def run(requests: int, in_flight: int, max_tokens: int, workdir: Path) -> dict[str, Any]:
    settings = config(in_flight)
    with segfuse_server(workdir, "budget", settings, startup_s=600) as server:
        return drive(server, settings["server"]["max_loaded_bytes"], requests, in_flight, max_tokens)


def main(argv: list[str] | None = None) -> int:
    return command(
        argv,
        __doc__ or "",
        run,
        4,
        "runs/budget.json",
        lambda result: result["failed"] == 0 and result["most_held_bytes"] <= result["bound_bytes"],
    )


if __name__ == "__main__":
    raise SystemExit(main())
