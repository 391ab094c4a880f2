"""Side-by-side speed benchmark: what the ensemble costs over its members (``segfuse bench``).

One run, one process family, the same prompts, greedy decoding and answers forced to the target length
(``ignore_eos``), for llama.cpp and transformers members alike, on the CPU or a GPU. It times the two
systems of ``systems.py`` (plain fusion and the default, the leader alone) and, for each answer length,
every system once per repetition on the same prompt (interleaved), summarised as median / min / max:

- ``fusion``: plain fusion (wall time, tokens/s, time to first segment ``fusion_ttfs``);
- ``default``: the default options (``default_ttfs``), against ``leader_alone`` (the leader's own session
  drafting the same tokens alone: its backend's loop) and, for a transformers leader, ``leader_generate``
  (Hugging Face ``model.generate`` on the same prompt tokens);
- ``members_sum``: each member alone generating the same tokens (prefill + decode), summed;
- ``floor``: the work the method cannot avoid, priced at each member's raw speeds (``speeds.py``): prompt
  prefill, its own draft decoded token by token and one batched read of the other members' candidates per
  round (token counts from the fusion run's backend counters);
- ``reference_method`` (llama.cpp members): the paper's code path as a mode of ours: every round every
  member re-encodes its whole context to draft and again to verify;
- ``response_level``: every member writes the whole answer, then every member scores every answer; its time
  to first token (``response_ttft``) is when the winner is known;
- ``{fusion,default}_{one_by_one,at_once}``: N requests one after another against the same N at once
  (``users.py``);
- peak RSS of the ensemble process vs. the members alone (``rss.py``; not on a GPU).

Before timing, every system runs once on a short answer, so that first-call costs (allocations, kernel
plans) are not counted in the first repetition. A deadline (the GPU check's time budget) stops a run
between repetitions; what was measured by then is reported.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ...backends.registry import MemberSpec
from ...ensemble import Ensemble
from ...eval.baselines import rerank
from ...models import DEFAULT_MODELS
from ...request import to_messages
from ...types import Result
from ..common.machine import git, machine
from .plan import Plan, check_reference, settle
from .rss import peak_rss_mb
from .speeds import backend_of, check_members, floor_seconds, generate_seconds, member_speeds
from .systems import (
    DEFAULT,
    GREEDY,
    PLAIN,
    PROMPTS,
    SYSTEMS,
    default_leader,
    describe_systems,
    member_alone_seconds,
    run_fusion,
    system_options,
)
from .table import plot_rounds, summary
from .users import measure_users

WARM_TOKENS = 8  # the warm-up answers' length


def new_report(plan: Plan, ens: Ensemble) -> dict[str, Any]:
    """The report's header: when, where, which code, which members and systems, what was left out."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git(),
        "window": plan.window,
        "reps": plan.reps,
        "users": plan.users,
        "systems": {name: system_options(name, plan.window) for name in SYSTEMS},
        "models": ens.names,
        "members": {m.name: member_info(m) for m in ens.members},
        "threads": {m.name: getattr(m, "threads", None) for m in ens.members if backend_of(m) == "llama_cpp"},
        "skipped": list(plan.skipped),
        "lengths": {},
    }


def member_info(member: Any) -> dict[str, Any]:
    info = {"backend": backend_of(member), "placement": member.placement, "n_params": member.n_params}
    if info["backend"] == "transformers":
        import torch

        info["dtype"] = str(member.weights.dtype).removeprefix("torch.")
        info["threads"] = torch.get_num_threads()
    return info


def run(
    plan: Plan, models: list[str] | None = None, out: Path = Path("runs/bench"), log: Callable[[str], None] = print
) -> dict[str, Any]:
    """The whole benchmark, for the CLI: load, warm up, every length, the users, RSS; bench.json in `out`."""
    specs = list(models or DEFAULT_MODELS)
    plan = check_reference(plan, specs)
    out.mkdir(parents=True, exist_ok=True)
    for line in describe_systems(plan.window):
        log(line)
    # No prefix cache between requests: every repetition pays for its prompt, as the members alone do.
    with Ensemble(specs, prefix_cache_cells=0) as ens, ExitStack() as stack:
        check_members(ens.members)
        plan = settle(plan, ens)
        report = new_report(plan, ens)
        reference = stack.enter_context(Ensemble(specs, reencode=True)) if plan.reference else None
        crowd = stack.enter_context(users_ensemble(ens, specs, plan.users)) if plan.users else None
        warm_up(ens, reference, crowd, plan, log)
        last: Result | None = None
        for length in plan.lengths:
            rows, last = measure_length(ens, reference, plan, length, log)
            if crowd is not None:
                rows.update(measure_users(crowd, plan, length, log))
            entry = report["lengths"][str(length)] = summary(rows)
            if plan.rss:
                entry.update(rss_rows(specs, length))
    if last is not None and plan.plot:
        report["plot"] = str(plot_rounds(last, out / "bench_rounds.png"))
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    return report


def rss_rows(specs: list[str], length: int) -> dict[str, Any]:
    """Peak RSS of the ensemble's process against each member's alone (children, one after another)."""
    ensemble = peak_rss_mb("ensemble", length, specs)
    alone = [peak_rss_mb("member", length, [spec]) for spec in specs]
    names = [MemberSpec.parse(s).target for s in specs]
    return {"rss_mb": {"ensemble": ensemble, "members": dict(zip(names, alone))}, "rss_ratio": ensemble / sum(alone)}


@contextmanager
def users_ensemble(ens: Ensemble, specs: list[str], users: int) -> Iterator[Ensemble]:
    """An ensemble whose members hold `users` sessions at once: `ens` itself where they do (transformers
    members hold any number), else the same members loaded again with that many slots (llama.cpp)."""
    if all(m.slots is None or m.slots >= users for m in ens.members):
        yield ens
        return
    with Ensemble(specs, prefix_cache_cells=0, slots=users) as crowd:
        yield crowd


def warm_up(
    ens: Ensemble,
    reference: Ensemble | None,
    crowd: Ensemble | None,
    plan: Plan,
    log: Callable[[str], None] = print,
) -> float:
    """Every system once on a short answer (first-call costs out of the first repetition); its seconds."""
    t0 = time.perf_counter()
    prompt, tokens = PROMPTS[0], min(WARM_TOKENS, *plan.lengths)
    messages = to_messages(prompt)
    for system in SYSTEMS:
        run_fusion(ens, prompt, tokens, plan.window, system)
    context = len(ens.members[0].prompt_tokens(messages) or []) + tokens
    for member in ens.members:
        member_alone_seconds(member, messages, tokens)
        generate_seconds(member, messages, tokens)
        member_speeds(member, messages, context, plan.window, repeats=1)
    if reference is not None:
        run_fusion(reference, prompt, tokens, plan.window)
    if plan.response_level:
        rerank(ens.members, messages, max_tokens=tokens, sampling=GREEDY)
    if crowd is not None:
        measure_users(crowd, replace(plan, reps=1, deadline=None), tokens, log=lambda _: None)
    seconds = time.perf_counter() - t0
    log(f"warm-up: every system once on {tokens} tokens, {seconds:.1f}s")
    return seconds


def measure_length(
    ens: Ensemble, reference: Ensemble | None, plan: Plan, length: int, log: Callable[[str], None] = print
) -> tuple[dict[str, list[float]], Result | None]:
    """`plan.reps` repetitions at one answer length (each on the next prompt): the rows, and the last plain
    fusion result (for the per-round plot)."""
    log(f"== answers of {length} tokens, {plan.reps} repetitions")
    rows: dict[str, list[float]] = {}
    last = None
    for rep in range(plan.reps):
        if plan.deadline is not None and time.monotonic() > plan.deadline:
            log(f"  time budget spent after {rep} repetition(s)")
            break
        last = repetition(ens, reference, plan, PROMPTS[rep % len(PROMPTS)], length, rows)
        log(f"  rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rows.items() if not k.endswith("_tokens")))
    return rows, last


def repetition(
    ens: Ensemble, reference: Ensemble | None, plan: Plan, prompt: str, length: int, rows: dict[str, list[float]]
) -> Result:
    """One prompt, every system side by side: appends a time (or count) to each row; returns plain fusion's
    result."""

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    messages = to_messages(prompt)
    result = run_fusion(ens, prompt, length, plan.window, PLAIN)
    add("fusion", result.stats.total_s)
    add("fusion_ttfs", result.stats.time_to_first_segment_s or 0.0)
    add("fusion_tokens", result.stats.tokens)
    add("floor", floor_seconds(result.counters, fusion_speeds(ens, result, messages, length)))
    alone = {m.name: member_alone_seconds(m, messages, length) for m in ens.members}
    add("members_sum", sum(alone.values()))
    default = run_fusion(ens, prompt, length, plan.window, DEFAULT)
    add("default", default.stats.total_s)
    add("default_ttfs", default.stats.time_to_first_segment_s or 0.0)
    add("default_tokens", default.stats.tokens)
    leader = default_leader(default)
    add("leader_alone", alone[leader])
    generated = generate_seconds(ens.pick([leader])[0], messages, length)
    if generated is not None:
        add("leader_generate", generated)
    if reference is not None:
        add("reference_method", run_fusion(reference, prompt, length, plan.window).stats.total_s)
    if plan.response_level:
        response = rerank(ens.members, messages, max_tokens=length, sampling=GREEDY)
        add("response_level", response.total_s)
        add("response_ttft", response.ttft_s or response.total_s)
    return result


def fusion_speeds(ens: Ensemble, result: Result, messages: Any, length: int) -> dict[str, dict[str, float]]:
    """Each member's raw speeds at the mid-answer context, its batch the run's mean verification size."""
    context = len(ens.members[0].prompt_tokens(messages) or []) + length // 2
    speeds = {}
    for member in ens.members:
        c = result.counters.get(member.name)
        if c is None:  # never started (only under options that leave members on standby)
            continue
        batch = max(1, round(c["verify"] / max(c["verify_calls"], 1)))
        speeds[member.name] = member_speeds(member, messages, context, batch)
    return speeds
