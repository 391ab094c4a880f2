"""The leader's first words against llama-cpp-python's server: the chat benchmark's traffic, two servers only.

Runs `segfuse bench chat`'s traffic and measurements (``chat.run``) on the ``cache`` server and the anchor only
(the ``no-cache`` server, which reads every long prompt again, is left out for time), the chat without the users
by default, repetitions in alternating order. Writes the report, with the load average at start and end, as JSON,
and prints the cache's ratios to the anchor on the chat.

    python -m segfuse.bench.chat.leader_words --reps 2 --out docs/results/chat/bench-chat-leader-words-COMMIT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .run import run

SYSTEMS = ("cache", "llama-server")
RATIOS = ("chat_ttfs_cache_over_anchor", "chat_first_words_cache_over_anchor", "chat_total_cache_over_anchor")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--users", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    report = run(**vars(args), systems=SYSTEMS)  # the flags are run's own keywords
    ratios = report["summary"]["ratios"]
    print(json.dumps({k: ratios[k] for k in RATIOS}, indent=1))


if __name__ == "__main__":
    main()
