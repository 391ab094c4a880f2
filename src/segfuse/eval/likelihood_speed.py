"""Scoring speed: an item scored by every member at once against each member scoring it alone.

Per item, in turn: the ensemble scores it, then each member alone (so load changes hit both alike).
Prints items per second and the ratio of the ensemble's time to the sum of the members' times::

    python -m segfuse.eval.likelihood_speed --task arithmetic-2_digit_addition --start 100 --stop 110

With ``--slots N`` (N > 1) it measures batching instead, on members that hold N sessions: the
items one at a time against all of them through ``score_many`` (N items' choices per decode),
after a warm-up, twice each in the order one, batched, batched, one (times summed); and each
member's largest difference between the two ways' log-probabilities of a choice.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

from .bigbench import items

if TYPE_CHECKING:
    from ..ensemble import Ensemble


def measure(ensemble: Ensemble, task: str, start: int, stop: int) -> dict[str, Any]:
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
    return {
        "task": task,
        "items": len(chosen),
        "ensemble_s": round(together, 3),
        "members_alone_s": round(alone, 3),
        "ratio": round(together / alone, 4),
        "items_per_s": round(len(chosen) / together, 4),
    }


def measure_batched(ensemble: Ensemble, task: str, start: int, stop: int) -> dict[str, Any]:
    chosen = [(item.context, list(item.choices)) for item in items(task, start, stop)]
    ensemble.score(*chosen[0])  # warm-up (weights paged in, buffers grown) before either is timed
    one_s = batched_s = 0.0
    for order in (("one", "batched"), ("batched", "one")):  # each first once: drift in the load hits both
        for mode in order:
            began = time.perf_counter()
            if mode == "one":
                alone = [ensemble.score(context, choices) for context, choices in chosen]
                one_s += time.perf_counter() - began
            else:
                batched = ensemble.score_many(chosen)
                batched_s += time.perf_counter() - began
    scored = [b for b in batched if not isinstance(b, Exception)]
    if len(scored) < len(batched):
        raise RuntimeError(f"items failed when batched: {[str(b) for b in batched if isinstance(b, Exception)]}")
    gap = {
        name: max(
            abs(x.logprob - y.logprob) for a, b in zip(alone, scored) for x, y in zip(a.members[name], b.members[name])
        )
        for name in ensemble.names
    }
    n = 2 * len(chosen)  # every item scored twice each way
    return {
        "task": task,
        "items": len(chosen),
        "slots": ensemble.slots,
        "one_at_a_time_s": round(one_s, 3),
        "batched_s": round(batched_s, 3),
        "items_per_s_one": round(n / one_s, 4),
        "items_per_s_batched": round(n / batched_s, 4),
        "speedup": round(one_s / batched_s, 3),
        "max_logprob_gap": gap,
    }  # per member, in nats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="arithmetic-2_digit_addition")
    parser.add_argument("--start", type=int, default=100)
    parser.add_argument("--stop", type=int, default=110)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--slots", type=int, default=1, help="over 1: one at a time against batches of this many")
    args = parser.parse_args(argv)
    from ..ensemble import Ensemble

    with Ensemble(threads=args.threads, prefix_cache_cells=0, slots=args.slots) as ensemble:
        run = measure_batched if args.slots > 1 else measure
        print(json.dumps(run(ensemble, args.task, args.start, args.stop)))


if __name__ == "__main__":
    main()
