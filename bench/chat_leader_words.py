"""The leader's first words against llama-cpp-python's server: the chat benchmark's traffic, two servers only.

Runs `segfuse bench --serve --chat`'s traffic and measurements (``segfuse.bench.chat``: the servers,
``one_repetition``, ``summarise``) on the ``cache`` server and the anchor only (the ``no-cache`` server,
which reads every long prompt again, is left out for time), the chat without the users by default,
repetitions in alternating order. Writes the report, with the load average at start and end, as JSON.

    .venv/bin/python bench/chat_leader_words.py --reps 2 --out docs/results/chat/bench-chat-leader-words-COMMIT.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import ExitStack
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from segfuse.bench.chat import LEADER, Target, ask, one_repetition, summarise
from segfuse.bench.machine import git, loadavg, machine
from segfuse.bench.processes import (
    llama_cpp_server,
    segfuse_server,
    sigterm_as_interrupt,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--users", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from segfuse.models import CATALOGUE, model_path

    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git(),
        "settings": {
            "reps": args.reps,
            "max_tokens": args.max_tokens,
            "threads": args.threads,
            "turns": args.turns,
            "users": args.users,
            "sections": None,
            "leader": LEADER,
            "systems": ["cache", "llama-server"],
        },
        "loadavg": {"start": loadavg()},
        "replies": [],
    }
    with (
        sigterm_as_interrupt(),
        tempfile.TemporaryDirectory(prefix="segfuse-leader-words-") as tmp,
        ExitStack() as stack,
    ):
        config = {
            "server": {"api_key": "bench-key", "max_concurrent": 1},
            "members": {"threads": args.threads, "prefix_cache_cells": None},
        }
        ours = stack.enter_context(segfuse_server(Path(tmp), "cache", config))
        anchor = stack.enter_context(
            llama_cpp_server(
                model_path(CATALOGUE[LEADER]),
                Path(tmp) / "llama-server.log",
                threads=args.threads,
                n_ctx=4096,
                extra_args=("--cache", "true"),
            )
        )
        servers = [
            Target("cache", ours.api, "bench-key", "segfuse", ours.health),
            Target("llama-server", anchor.url, "", LEADER),
        ]
        for server in servers:  # warm-up: the first request of a process pays for loading pages
            ask(server, -1, "warm-up", 0, [{"role": "user", "content": "Hello."}], 4)
        for rep in range(args.reps):
            for server in servers if rep % 2 == 0 else servers[::-1]:
                replies = one_repetition(server, rep, args.max_tokens, args.turns, args.users)
                report["replies"] += [asdict(r) for r in replies]
                print(
                    f"rep {rep + 1} {server.name:12} load {loadavg()} "
                    + " ".join(f"{r.kind[0]}{r.index}:{r.ttfs_s or 0:.2f}" for r in replies),
                    flush=True,
                )
    report["loadavg"]["end"] = loadavg()
    report["summary"] = summarise(report["replies"], args.turns, args.users)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    ratios = report["summary"]["ratios"]
    print(
        json.dumps(
            {
                k: ratios[k]
                for k in (
                    "chat_ttfs_cache_over_anchor",
                    "chat_first_words_cache_over_anchor",
                    "chat_total_cache_over_anchor",
                )
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
