"""What one call to a Ray member costs against the same member loaded in this process.

Each call a round makes is timed on one session, `n` times, its effect dropped after each (so that
every call starts from the same context): opening and closing a session, accepting a word, a
1-token greedy draft, a 10-token draft whose text streams to a hook as it is sampled (what the
leader does when it answers alone), and a score of 4 candidates. The medians, Ray and local side by
side, and what Ray adds per call (and, for the streamed draft, per token) are what the serving
benchmark's report prints (``serving.py``).

:func:`measure` starts a local Ray instance on a loopback node, one copy of the member, and stops
both when done; :func:`call_costs` times the calls on any member (the tests use it on a cluster of
their own).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from ...backends.base import Member
from ...types import Message, Sampling

PROMPT = "Name three primary colors."
CANDIDATES = (" Red", " Blue, green", " The", "")
GREEDY = Sampling(0.0, 1.0, 0)
STREAMED_TOKENS = 10
CALLS = ("open + close", "accept", "draft 1 token", f"draft {STREAMED_TOKENS} tokens, streamed", "score 4 candidates")


def median_ms(call: Callable[[], Any], then: Callable[[], Any], n: int) -> float:
    """The median time of `call` over `n` calls, `then` run after each (untimed)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        then()
    return 1000 * statistics.median(times)


def call_costs(member: Member, n: int = 30) -> tuple[dict[str, float], tuple[Any, Any]]:
    """Median ms of each of :data:`CALLS` on `member`; and one more 1-token draft and score, their values
    (a Ray member must give the local member's)."""
    messages = [Message("user", PROMPT)]
    session = member.start(messages, seed=0, reserve=16)
    pieces: list[str] = []

    def drop() -> None:
        session.accept("")

    def reopen() -> None:
        member.start(messages, seed=0, reserve=16).close()

    try:
        figures = {
            CALLS[0]: median_ms(reopen, lambda: None, n),
            CALLS[1]: median_ms(lambda: session.accept(" Red"), lambda: session.accept(""), n),
            CALLS[2]: median_ms(lambda: session.draft(1, GREEDY), drop, n),
            CALLS[3]: median_ms(lambda: session.draft(STREAMED_TOKENS, GREEDY, pieces.append), drop, n),
            CALLS[4]: median_ms(lambda: session.score(list(CANDIDATES)), drop, n),
        }
        values = (session.draft(1, GREEDY), session.score(list(CANDIDATES)))
    finally:
        session.close()
    return figures, values


def compare(ray: dict[str, float], local: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per call: Ray's and the local median, what Ray adds, and the ratio."""
    return {
        name: {
            "ray_ms": ray[name],
            "local_ms": local[name],
            "added_ms": ray[name] - local[name],
            "ratio": ray[name] / local[name] if local[name] else float("nan"),
        }
        for name in ray
    }


def measure(
    model: str = "qwen2.5-coder-0.5b",
    threads: int = 1,
    n: int = 30,
    node_ip: str = "127.0.0.2",
    cache_dir: str | None = None,
) -> dict[str, Any]:
    """:func:`call_costs` on `model` as a Ray member (one copy in a local Ray instance on `node_ip`, started
    and stopped here) and loaded here; the same values from both, or an error."""
    import ray

    from ...backends.ray.host import create_hosts
    from ...backends.ray.member import RayMember
    from ...backends.ray.settings import RaySettings
    from ...backends.registry import load_member
    from ...member_options import MemberOptions

    given = {"threads": threads, "prefix_cache_cells": 0, "n_ctx": 1024, "slots": 2, "cache_dir": cache_dir}
    shared = MemberOptions.build({k: v for k, v in given.items() if v is not None}, where="ray_calls")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # else Ray reports its usage over the internet
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=max(2, threads),
            include_dashboard=False,
            logging_level=logging.WARNING,
            _node_ip_address=node_ip,
        )
    try:
        remote = RayMember(create_hosts(model, shared, RaySettings(cpus=float(threads))), owned=True)
        try:
            ray_figures, ray_values = call_costs(remote, n)
        finally:
            remote.close()
    finally:
        if started:
            ray.shutdown()
    local = load_member(model, shared)
    try:
        local_figures, local_values = call_costs(local, n)
    finally:
        local.close()
    return {
        "model": model,
        "threads": threads,
        "n": n,
        "same_values": ray_values == local_values,
        "calls": compare(ray_figures, local_figures),
    }


def format_rows(costs: dict[str, Any]) -> list[list[str]]:
    """call, Ray ms, local ms, added ms (per token for a streamed draft), ratio."""
    rows = []
    for name, c in costs["calls"].items():
        added = f"{c['added_ms']:+.2f}"
        if name == CALLS[3]:
            added += f" ({c['added_ms'] / STREAMED_TOKENS:+.2f} per token)"
        rows.append([name, f"{c['ray_ms']:.2f}", f"{c['local_ms']:.2f}", added, f"{c['ratio']:.2f}×"])
    return rows


__all__ = ["CALLS", "call_costs", "compare", "format_rows", "measure", "median_ms"]
