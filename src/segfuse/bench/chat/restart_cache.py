"""How much a prefix cache kept across restarts saves: the first segment of a request with a long system prompt,
cold and after a restart that reads the prompt back from ``prefix_cache_dir``.

``python -m segfuse.bench.chat.restart_cache [--items 3] [--max-tokens 32] [--vote] [--out FILE]``:
each item is its own system prompt of about 2,000 tokens (rules in another order) and a question. The
first ensemble (the default embedded members, with a fresh directory) answers every item cold and
writes its cached prefixes after each (as the server does every few minutes); it is closed, and a
second ensemble on the same directory (a restart) answers the same items, each reading its prompt
back from disk; then once more, from memory (``--vote``: every proposal to the vote, no gate, so every
member reads the prompt, not the leader alone). Timed: from the call to the first segment of the
answer (opening the sessions, reading back, and decoding what is left of the prompt, included).
Prints the ratio restart/cold (target: at most 0.3) and writes a JSON record.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from ...ensemble import Ensemble
from ...types import DoneEvent, Message, Result, SegmentEvent
from ..common.machine import git, loadavg, machine

ITEMS = ["atlases", "maps", "newspapers", "journals", "recordings", "films", "manuscripts", "theses"]
TARGET = 0.3


def system_prompt(item: int, rules: int = 60) -> str:
    """About 2,000 tokens for each embedded member: the library's rules, in an order of the item's own."""
    lines = [
        f"Rule {i}: {ITEMS[i % 8]} of shelf {i} may be borrowed for {i % 5 + 2} weeks by members of "
        f"group {chr(65 + i % 7)}, renewed {i % 3} times, and returned to desk {i % 4 + 1}."
        for i in range(rules)
    ]
    random.Random(item).shuffle(lines)
    return "You are the library's assistant. Answer in one short sentence, using only these rules.\n" + "\n".join(lines)


def chat(item: int) -> list[Message]:
    return [
        Message("system", system_prompt(item)),
        Message("user", f"For how many weeks may {ITEMS[item % 8]} of shelf {item} be borrowed?"),
    ]


def first_segment(ensemble: Ensemble, messages: list[Message], options: dict[str, Any]) -> tuple[float, Result]:
    """Seconds from the call to the answer's first segment, and the whole result."""
    start = time.perf_counter()
    first = None
    result = None
    for event in ensemble.stream(messages, temperature=0.0, **options):
        if first is None and isinstance(event, SegmentEvent):
            first = time.perf_counter() - start
        if isinstance(event, DoneEvent):
            result = event.result
    assert first is not None and result is not None
    return first, result


def save(ensemble: Ensemble) -> float:
    start = time.perf_counter()
    for member in ensemble.members:
        member.save_prefix_cache()
    return time.perf_counter() - start


def figures(ensemble: Ensemble) -> dict[str, dict[str, int]]:
    """Per member, what its prefix cache read back, reused and wrote so far."""
    seen = {}
    for member in ensemble.members:
        prefix = member.occupancy().prefix
        if prefix is not None:
            seen[member.name] = {"restored": prefix.restored, "reused_tokens": prefix.reused_tokens}
    return seen


def run(items: int, max_tokens: int, directory: Path, threads: int | None, vote: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"prefix_cache_dir": str(directory)}
    if threads:
        options["threads"] = threads
    asked: dict[str, Any] = {"max_tokens": max_tokens}
    if vote:  # every proposal to the vote: every member reads the prompt for the first segment
        asked.update(accept_margin=None, gate=None)
    rows: list[dict[str, Any]] = [{"item": i} for i in range(items)]
    with Ensemble(**options) as first:
        for row in rows:
            cold_s, cold = first_segment(first, chat(row["item"]), asked)
            row["cold_s"], row["save_s"] = round(cold_s, 3), round(save(first), 3)
            row["answer_cold"] = cold.text
            row["prompt_tokens"] = {n: c["prompt"] + c["reused"] for n, c in cold.counters.items()}
    files = sorted(directory.glob("*.segkv"))
    started = time.perf_counter()
    with Ensemble(**options) as second:
        load_s = time.perf_counter() - started
        for row in rows:
            restart_s, warm = first_segment(second, chat(row["item"]), asked)
            row["restart_s"], row["answer_restart"] = round(restart_s, 3), warm.text
            row["reused"] = {n: c["reused"] for n, c in warm.counters.items()}
            row["memory_s"] = round(first_segment(second, chat(row["item"]), asked)[0], 3)
            print(
                f"item {row['item']}: first segment cold {row['cold_s']:.2f} s, after a restart "
                f"{row['restart_s']:.2f} s ({row['restart_s'] / row['cold_s']:.2f}x), from memory {row['memory_s']:.2f} s"
            )
        caches = figures(second)
    cold_s, restart_s = sum(r["cold_s"] for r in rows), sum(r["restart_s"] for r in rows)
    return {
        "machine": machine(),
        "git": git(),
        "loadavg": loadavg(),
        "items": f"{items} system prompts of 60 rules (about 2,000 tokens), each with one question",
        "members": "the embedded default three" + (", every proposal to the vote" if vote else ""),
        "threads": threads,
        "max_tokens": max_tokens,
        "cold_s": round(cold_s, 3),
        "restart_s": round(restart_s, 3),
        "memory_s": round(sum(r["memory_s"] for r in rows), 3),
        "ratio": round(restart_s / cold_s, 3),
        "target": TARGET,
        "load_s_after_restart": round(load_s, 3),
        "files": len(files),
        "file_bytes": sum(p.stat().st_size for p in files),
        "answers_identical": sum(r["answer_cold"] == r["answer_restart"] for r in rows),
        "caches_after_restart": caches,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads per member (default: theirs)")
    parser.add_argument("--vote", action="store_true", help="every proposal to the vote (accept_margin and gate none)")
    parser.add_argument("--dir", default=None, help="the prefix-cache directory (default: a fresh temporary one)")
    parser.add_argument("--out", default="runs/restart-cache.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="segfuse-restart-") as scratch:
        directory = Path(args.dir) if args.dir else Path(scratch)
        if directory.is_dir() and any(directory.iterdir()):
            parser.error(f"{directory} is not empty: the first answers must be cold")
        report = run(args.items, args.max_tokens, directory, args.threads, args.vote)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"first segment: cold {report['cold_s']:.2f} s, after a restart {report['restart_s']:.2f} s: "
        f"{report['ratio']:.2f}x (target at most {TARGET}x); from memory {report['memory_s']:.2f} s; "
        f"{report['answers_identical']} of {len(report['rows'])} answers identical; {report['files']} files, "
        f"{report['file_bytes'] / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
