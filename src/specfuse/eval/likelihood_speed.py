"""Scoring speed: an item scored by every member at once against each member scoring it alone.

Per item, in turn: the ensemble scores it, then each member alone (so load changes hit both alike).
Prints items per second and the ratio of the ensemble's time to the sum of the members' times::

    python -m specfuse.eval.likelihood_speed --task arithmetic-2_digit_addition --start 100 --stop 110
"""

from __future__ import annotations

import argparse
import json
import time

from .bigbench import items


def measure(ensemble, task: str, start: int, stop: int) -> dict:
    together = alone = 0.0
    chosen = items(task, start, stop)
    for item in chosen:
        began = time.perf_counter()
        ensemble.score(item.context, list(item.choices))
        together += time.perf_counter() - began
        for name in ensemble.names:
            began = time.perf_counter()
            ensemble.score(item.context, list(item.choices), members=[name])
            alone += time.perf_counter() - began
    return {"task": task, "items": len(chosen), "ensemble_s": round(together, 3), "members_alone_s": round(alone, 3),
            "ratio": round(together / alone, 4), "items_per_s": round(len(chosen) / together, 4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="arithmetic-2_digit_addition")
    parser.add_argument("--start", type=int, default=100)
    parser.add_argument("--stop", type=int, default=110)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from ..ensemble import Ensemble

    with Ensemble(threads=args.threads, prefix_cache_cells=0) as ensemble:
        print(json.dumps(measure(ensemble, args.task, args.start, args.stop)))


if __name__ == "__main__":
    main()
