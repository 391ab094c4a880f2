"""Record every member's scores of every choice of BIG-bench items (resumable JSONL per task).

One record per item holds what any pooling rule needs (each member's summed log-probability,
tokens and greedy flag per choice, the choices' bytes) and the seconds each member took, so
the members alone and every rule are compared afterwards on the same scores
(``likelihood_report.py``)::

    python -m segfuse.eval.likelihood_study --start 0 --stop 40 \\
        --out docs/results/likelihood/study --threads 1 --tasks social_iqa,date_understanding
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..likelihood import ItemScores
from .bigbench import DATA_DIR, TASKS, Item, items

if TYPE_CHECKING:
    from ..ensemble import Ensemble


def record_of(item: Item, scored: ItemScores) -> dict[str, Any]:
    """The JSON record of one scored item."""
    return {
        "task": item.task,
        "index": item.index,
        "correct": list(item.correct),
        "bytes": [len(c.encode("utf-8")) for c in scored.choices],
        "members": {
            name: {
                "logprob": [round(s.logprob, 5) for s in row],
                "tokens": [s.tokens for s in row],
                "greedy": [s.greedy for s in row],
            }
            for name, row in scored.members.items()
        },
        "seconds": {name: round(s, 4) for name, s in scored.seconds.items()},
    }


def done_indices(path: Path) -> set[int]:
    """Items already recorded in `path` (a last line cut by an interrupted run is ignored)."""
    found: set[int] = set()
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                found.add(int(json.loads(line)["index"]))
            except (ValueError, KeyError):
                continue
    return found


def run(
    ensemble: Ensemble,
    tasks: Sequence[str],
    start: int,
    stop: int,
    out_dir: str | Path,
    data_dir: str | Path = DATA_DIR,
    progress: bool = True,
) -> int:
    """Score items ``start..stop`` of each task with every member of `ensemble`; returns items written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for task in tasks:
        path = out / f"{task}.jsonl"
        done = done_indices(path)
        todo = [i for i in items(task, start, stop, data_dir) if i.index not in done]
        with path.open("a", encoding="utf-8") as sink:
            for item in todo:
                scored = ensemble.score(item.context, list(item.choices))
                sink.write(json.dumps(record_of(item, scored)) + "\n")
                sink.flush()
                written += 1
                if progress:
                    print(f"{task} {item.index}: {sum(scored.seconds.values()):.2f} s", file=sys.stderr)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--stop", type=int, default=40)
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", default=str(DATA_DIR))
    parser.add_argument("--models", default=None, help="members joined by | (default: the embedded three)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--prefix-cache-cells",
        type=int,
        default=0,
        help="0 (default): every item is decoded on an empty cache, so its scores do not depend on the items before it",
    )
    args = parser.parse_args(argv)
    from ..ensemble import Ensemble

    options = {"threads": args.threads} if args.threads else {}
    options["prefix_cache_cells"] = args.prefix_cache_cells
    names = args.models.split("|") if args.models else None
    with Ensemble(names, **options) as ensemble:
        run(ensemble, [t for t in args.tasks.split(",") if t], args.start, args.stop, args.out, args.data)


if __name__ == "__main__":
    main()
