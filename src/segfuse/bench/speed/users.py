"""N requests at once against the same N one by one, for each system (``segfuse bench speed --users N``).

At once, the N prompts go to ``Ensemble.generate_many(max_concurrent=N)``, which batches the members'
work across them; one by one, the same prompts go to ``generate`` one after another. Both on the same
ensemble, greedy, forced to the same length; the throughput ratio is one-by-one time / at-once time
(above 1: answering together is faster).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ...ensemble import Ensemble
from .plan import Plan
from .systems import PROMPTS, ROW_PREFIX, SYSTEMS, fusion_options, timed


def user_prompts(users: int, rep: int) -> list[str]:
    """`users` prompts, the fixed ones in turn, starting one further along each repetition."""
    return [PROMPTS[(rep + i) % len(PROMPTS)] for i in range(users)]


def one_by_one(ens: Ensemble, prompts: list[str], length: int, window: int, system: str) -> float:
    options = fusion_options(length, window, system)

    def answer_all() -> None:
        for prompt in prompts:
            ens.generate(prompt, **options)

    return timed(answer_all)[0]


def at_once(ens: Ensemble, prompts: list[str], length: int, window: int, system: str) -> float:
    options = fusion_options(length, window, system)
    seconds, results = timed(lambda: ens.generate_many(prompts, max_concurrent=len(prompts), **options))
    short = [r.stats.tokens for r in results if r.stats.tokens != length]
    if short:
        raise RuntimeError(f"{system}: answers of {short} tokens at once, not {length}")
    return seconds


def measure_users(ens: Ensemble, plan: Plan, length: int, log: Callable[[str], None] = print) -> dict[str, list[float]]:
    """Rows ``{fusion,default}_{one_by_one,at_once}``: seconds for `plan.users` answers of `length` tokens, per
    repetition (`plan.reps`), every system once per repetition (one by one, then at once); no new pair starts
    past `plan.deadline`."""
    users = plan.users
    rows: dict[str, list[float]] = {f"{ROW_PREFIX[s]}_{how}": [] for s in SYSTEMS for how in ("one_by_one", "at_once")}
    for rep in range(plan.reps):
        prompts = user_prompts(users, rep)
        for system in SYSTEMS:
            if plan.deadline is not None and time.monotonic() > plan.deadline:
                log(f"  users: time budget spent after {rep} repetition(s)")
                return rows
            prefix = ROW_PREFIX[system]
            rows[f"{prefix}_one_by_one"].append(one_by_one(ens, prompts, length, plan.window, system))
            rows[f"{prefix}_at_once"].append(at_once(ens, prompts, length, plan.window, system))
            log(
                f"  users rep {rep + 1}: {system}: {users} one by one {rows[f'{prefix}_one_by_one'][-1]:.1f}s, "
                f"at once {rows[f'{prefix}_at_once'][-1]:.1f}s"
            )
    return rows
