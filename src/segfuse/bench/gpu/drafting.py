"""The GPU check's drafting rows: what drafting for the leader would gain on this card
(docs/design.md#drafting-for-the-leader).

Random weights make acceptance meaningless, so the rows time costs only, on the leader's cache of a
:data:`PREFIX_TOKENS`-token prefix:

- one forward pass of 1 token against a pass of k + 1 tokens (the leader's last token and k drafted, as it
  reads a draft: every position's logits, the verification mask) for k in :data:`DRAFT_LENGTHS`;
- each drafter's time per token (its bare cached decode) over the leader's: a 0.5B of the leader's family
  (``models.DRAFTER_SHAPES``) and the ensemble's 1.7B; the lookup drafts for nothing.

The speed-up is then predicted, by the planner's formula, for the acceptance rates of :data:`ACCEPTANCES`
(measured with real models on a CPU, :data:`SOURCE`): expected tokens kept per round over the round's cost
in leader tokens, ``expected_tokens(a, k) / (drafter_ratio * k + pass_ratio(k))``, at the best k.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from ...engine import expected_tokens  # the planner's own formula: the prediction and the planner agree
from ..speed.speeds import on_compute, synchronizer
from ..speed.systems import timed
from .diagnose import bare_loop

if TYPE_CHECKING:
    from ...backends.base import Member
    from ...backends.transformers import TransformersMember

PREFIX_TOKENS = 384  # the cached prefix a round's pass reads after: a prompt and some answer
DRAFT_LENGTHS = (2, 4, 8, 16)
PASSES = 8  # passes per timing: one pass of a 7B on a card is a few milliseconds
LOOKUP = "lookup"
SOURCE = (
    "measured on a 2-core CPU with qwen2.5-coder-0.5b / smollm2-135m drafting for qwen2.5-coder-1.5b, "
    "40 prompts (docs/results/bench/drafting-6364514.json)"
)


@dataclass(frozen=True)
class Acceptance:
    """A per-token acceptance measured with real models, and the drafter shape it is predicted for."""

    drafter: str  # a drafter shape's name, or LOOKUP
    rate: float  # tokens kept per token proposed: at most the chance per token (a draft stops at its first miss)
    measured: str  # what was measured
    overall: bool = True  # over all the benchmark's tasks (its drafter's best row), else on one task


ACCEPTANCES = (
    Acceptance("qwen2.5-0.5b", 0.59, "qwen2.5-coder-0.5b, same family and vocabulary, all tasks"),
    Acceptance("qwen2.5-0.5b", 0.60, "qwen2.5-coder-0.5b on code edits", overall=False),
    # a smaller drafter of another vocabulary: a floor for the 1.7B of its family
    Acceptance("smollm2-1.7b", 0.43, "smollm2-135m, another vocabulary, all tasks"),
    Acceptance(LOOKUP, 0.76, "prompt lookup as auto asks it, all tasks"),
    Acceptance(LOOKUP, 0.91, "prompt lookup as auto asks it, on code edits", overall=False),
)


def speedup(acceptance: float, length: int, drafter_ratio: float, pass_ratio: float) -> float:
    """Tokens per second over the leader alone: a round drafts `length` tokens and reads them in one pass."""
    return expected_tokens(acceptance, length) / (drafter_ratio * length + pass_ratio)


def predict(acceptance: Acceptance, drafter_ratio: float, pass_ratios: dict[int, float]) -> dict[str, Any]:
    """The predicted speed-up at every draft length, and the best."""
    gains = {k: speedup(acceptance.rate, k, drafter_ratio, pass_ratios[k]) for k in DRAFT_LENGTHS}
    best = max(gains, key=lambda k: gains[k])
    return {
        "drafter": acceptance.drafter,
        "acceptance": acceptance.rate,
        "measured": acceptance.measured,
        "overall": acceptance.overall,
        "drafter_ratio": round(drafter_ratio, 4),
        "speedup": {str(k): round(g, 3) for k, g in gains.items()},
        "best_k": best,
        "best_speedup": round(gains[best], 3),
    }


def prefix(member: Member, prompt: str) -> list[int]:
    """`PREFIX_TOKENS` tokens of the member's own vocabulary: its prompt's tokens, repeated."""
    from ...request import to_messages

    tokens = member.prompt_tokens(to_messages(prompt)) or [0]
    return (tokens * (PREFIX_TOKENS // len(tokens) + 1))[:PREFIX_TOKENS]


def pass_seconds(member: TransformersMember, ids: Sequence[int], sizes: Sequence[int], reps: int) -> dict[int, float]:
    """Median seconds of one forward pass of each size after `ids` (cached), logits at every position; sizes
    above 1 masked as a draft is read. Run on the member's compute thread, where its passes run."""
    from transformers import DynamicCache

    weights, sync = member.weights, synchronizer(member)
    cache = DynamicCache()
    weights.forward(cache, ids, range(len(ids)), last_only=True)
    n = len(ids)
    masks = {s: weights.block_mask(n, 0, [s]) if s > 1 else None for s in sizes}

    def passes(size: int) -> None:
        for _ in range(PASSES):
            weights.forward(cache, ids[:size], range(n, n + size), mask=masks[size])
            _back_to(cache, n)
        sync()

    for size in sizes:  # first-call costs (allocations, kernel plans) out of the timings
        passes(size)
    seconds: dict[int, list[float]] = {s: [] for s in sizes}
    for _ in range(reps):  # interleaved: a slow moment of the machine falls on every size alike
        for size in sizes:
            seconds[size].append(timed(partial(passes, size))[0] / PASSES)
    return {s: statistics.median(v) for s, v in seconds.items()}


def _back_to(cache: Any, length: int) -> None:
    """The cache cut back to its first `length` tokens (a negative crop: old and new transformers alike)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def decode_seconds(members: Sequence[Member], prompt: str, tokens: int, reps: int) -> dict[str, float]:
    """Each member's median seconds per token of its bare cached decode after its prefix, on its compute
    thread; the members in turn, `reps` times."""
    loops = {
        m.name: partial(on_compute(m), partial(bare_loop, cast("TransformersMember", m), prefix(m, prompt), tokens))
        for m in members
    }
    for loop in loops.values():
        loop()  # first-call costs out
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(reps):
        for name, loop in loops.items():
            seconds[name].append(float(loop()) / tokens)
    return {name: statistics.median(v) for name, v in seconds.items()}


def measure(leader: Member, drafters: Sequence[Member], prompt: str, tokens: int, reps: int) -> dict[str, Any]:
    """The drafting rows: the leader's passes, the drafters' time per token, the predicted speed-ups."""
    sizes = (1, *(k + 1 for k in DRAFT_LENGTHS))
    typed = cast("TransformersMember", leader)
    passes = on_compute(leader)(partial(pass_seconds, typed, prefix(leader, prompt), sizes, reps))
    per_token = decode_seconds([leader, *drafters], prompt, tokens, reps)
    pass_ratios = {k: passes[k + 1] / passes[1] for k in DRAFT_LENGTHS}
    ratios = {LOOKUP: 0.0} | {d.name: per_token[d.name] / per_token[leader.name] for d in drafters}
    predictions = [predict(a, ratios[a.drafter], pass_ratios) for a in ACCEPTANCES if a.drafter in ratios]
    return {
        "leader": leader.name,
        "prefix_tokens": PREFIX_TOKENS,
        "pass_ms": {str(s): round(1000 * t, 3) for s, t in passes.items()},
        "pass_ratio": {str(k): round(r, 3) for k, r in pass_ratios.items()},
        "ms_per_token": {name: round(1000 * t, 3) for name, t in per_token.items()},
        "drafter_ratio": {name: round(r, 4) for name, r in ratios.items()},
        "predictions": predictions,
        "best": best_per_drafter(predictions),
        "acceptance_source": SOURCE,
    }


def best_per_drafter(predictions: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each drafter's best predicted speed-up (over k) at its acceptance over all tasks, not one task's."""
    return {
        p["drafter"]: {"speedup": p["best_speedup"], "k": p["best_k"], "acceptance": p["acceptance"]}
        for p in predictions
        if p["overall"]
    }


def tables(figures: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the drafting rows, as the check prints them."""
    leader, ms = figures["leader"], figures["ms_per_token"]
    passes = [["1", f"{figures['pass_ms']['1']:.2f}", "1.00"]] + [
        [f"{k} + 1", f"{figures['pass_ms'][str(k + 1)]:.2f}", f"{figures['pass_ratio'][str(k)]:.2f}"]
        for k in DRAFT_LENGTHS
    ]
    drafters = [[name, f"{ms.get(name, 0.0):.2f}", f"{ratio:.3f}"] for name, ratio in figures["drafter_ratio"].items()]
    lengths = [str(k) for k in DRAFT_LENGTHS]
    predicted = [
        [
            p["drafter"],
            f"{p['acceptance']:.2f} ({p['measured']})",
            *(f"{p['speedup'][k]:.2f}" for k in lengths),
            f"{p['best_speedup']:.2f}x at k={p['best_k']}",
        ]
        for p in figures["predictions"]
    ]
    return [
        (
            f"drafting: the leader's ({leader}) pass after {figures['prefix_tokens']} cached tokens",
            ["tokens read", "ms", "x 1 token"],
            passes,
        ),
        (f"drafting: time per token ({leader}: {ms[leader]:.2f} ms)", ["drafter", "ms", "x leader"], drafters),
        (
            f"drafting: predicted speed-up (acceptance {figures['acceptance_source']})",
            ["drafter", "acceptance", *(f"k={k}" for k in lengths), "best"],
            predicted,
        ),
    ]
