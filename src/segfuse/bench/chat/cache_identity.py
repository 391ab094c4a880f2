"""Do answers change with the prefix cache? Greedy two-turn chats with the cache on and off, compared.

``python -m segfuse.bench.chat.cache_identity --items 20 [--offset 0] [--max-tokens 64]``: GSM8K questions
(../shared/data) as first turns, each answer sent back, then a fixed follow-up; the same chats run on
an ensemble without the cache and on one with it (each chat's second turn reuses its first), under
the default options (the leader alone). Prints and writes (``--out``, JSON) how many answers are
byte-identical, where the others part, and the prompt tokens each side decoded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ...ensemble import Ensemble
from ...eval.tasks import get_task
from ...types import Message
from ..common.machine import git, machine

FOLLOW_UP = "Now check your answer step by step and give the final number."


def chat(ensemble: Ensemble, question: str, max_tokens: int) -> tuple[list[str], int, int]:
    """Two turns; the answers, and the prompt tokens the members decoded and reused."""
    messages = [Message("user", question)]
    answers: list[str] = []
    decoded = reused = 0
    for follow_up in (None, FOLLOW_UP):
        if follow_up:
            messages += [Message("assistant", answers[-1]), Message("user", follow_up)]
        result = ensemble.generate(messages, temperature=0.0, max_tokens=max_tokens)
        answers.append(result.text)
        decoded += sum(c.get("prompt", 0) for c in result.counters.values())
        reused += sum(c.get("reused", 0) for c in result.counters.values())
    return answers, decoded, reused


def parted_at(a: str, b: str) -> int | None:
    """The first character where two answers differ (None: identical)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(items: int, offset: int, max_tokens: int) -> dict[str, Any]:
    questions = [item.prompt for item in get_task("gsm8k").load(offset=offset, limit=items)]
    rows: list[dict[str, Any]] = []
    with Ensemble(prefix_cache_cells=0) as off, Ensemble() as on:
        for index, question in enumerate(questions, offset):
            cold, warm = chat(off, question, max_tokens), chat(on, question, max_tokens)
            rows.append(
                {
                    "item": index,
                    "turns": [parted_at(a, b) for a, b in zip(cold[0], warm[0])],
                    "decoded_off": cold[1],
                    "decoded_on": warm[1],
                    "reused_on": warm[2],
                    "answers_off": cold[0],
                    "answers_on": warm[0],
                }
            )
            print(f"gsm8k {index}: parted at {rows[-1]['turns']}, prompt tokens decoded {cold[1]} -> {warm[1]}")
    turns = [t for row in rows for t in row["turns"]]
    return {
        "machine": machine(),
        "git": git(),
        "items": f"gsm8k test {offset}-{offset + items - 1}",
        "max_tokens": max_tokens,
        "answers": len(turns),
        "identical": sum(t is None for t in turns),
        "second_turns_identical": sum(row["turns"][1] is None for row in rows),
        "decoded_off": sum(r["decoded_off"] for r in rows),
        "decoded_on": sum(r["decoded_on"] for r in rows),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default="runs/cache-identity.json")
    args = parser.parse_args()
    report = run(args.items, args.offset, args.max_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{report['identical']} of {report['answers']} answers identical ({report['items']}); prompt tokens "
        f"decoded {report['decoded_off']} without the cache, {report['decoded_on']} with it"
    )


if __name__ == "__main__":
    main()
