"""`segfuse bench drafting`: drafting for the leader, side by side with the engines' own speculative decoding.

One run, the same prompts, greedy answers of at most ``max_tokens`` (ending where the model ends them), every
system on one prompt before the next prompt (paired), every model warmed up once first. Two families, each
against its own reference for "alone" measured in the same run:

- llama.cpp: ``llama_alone`` (llama-cpp-python's plain ``Llama``, greedy through the GGUF's chat template:
  the tokens/s reference), segfuse ``off`` / ``members`` / ``lookup`` / ``auto`` (``FusionOptions.draft``;
  ``off``: the leader answers alone through segfuse) and ``llama_pld`` (llama-cpp-python's prompt lookup
  decoding);
- transformers: ``hf_alone`` (``model.generate`` greedy: the reference), segfuse ``hf_off`` / ``hf_members``
  and ``hf_assisted`` (``generate`` with an assistant model: universal assisted generation when its
  vocabulary differs), on the same weights the segfuse members hold.

Answers are compared token by token (the leader's tokenizer) with the leader alone's: segfuse rows with
segfuse ``off`` (drafting must not change the answer), the engines' rows and ``off`` with their engine's
alone. The report (JSON) keeps every answer's figures; ``drafting_table.py`` summarises.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from ...backends.base import Member
from ...ensemble import Ensemble
from ..common.machine import git, machine
from .drafting_native import Answer, LlamaNative, hf_answer
from .drafting_prompts import task_prompts
from .drafting_table import summarise

MODES = ("off", "members", "lookup", "auto")  # FusionOptions.draft, the llama.cpp family's segfuse rows
HF_MODES = ("off", "members")
# Whose answer each system's is compared with: segfuse rows with segfuse's leader alone, the rest with their
# engine's own alone.
ANSWER_REFERENCE = {
    "off": "llama_alone",
    "members": "off",
    "lookup": "off",
    "auto": "off",
    "llama_pld": "llama_alone",
    "hf_off": "hf_alone",
    "hf_members": "hf_off",
    "hf_assisted": "hf_alone",
}
SPEED_REFERENCE = {"llama": "llama_alone", "hf": "hf_alone"}
WARM_TOKENS = 8


@dataclass(frozen=True)
class DraftingPlan:
    """What one run measures. `hf_per_task`: prompts per task for the transformers family (None: `per_task`;
    0: that family left out)."""

    tasks: tuple[str, ...] = ("chat", "code", "edit", "json", "gsm8k")
    per_task: int = 8
    max_tokens: int = 96
    threads: int = 2
    data: Path = Path("../shared/data")
    leader: str = "qwen2.5-coder-1.5b"
    drafters: tuple[str, ...] = ("qwen2.5-coder-0.5b", "smollm2-135m")
    hf_leader: str = "qwen2.5-coder-0.5b"
    hf_drafter: str = "smollm2-135m"
    hf_per_task: int | None = None
    draft_max: int = 16
    skipped: list[str] = field(default_factory=list)

    @property
    def hf_prompts(self) -> int:
        return self.per_task if self.hf_per_task is None else self.hf_per_task


def segfuse_answer(
    ens: Ensemble, leader: str, mode: str, prompt: str, max_tokens: int, draft_max: int
) -> dict[str, Any]:
    """One segfuse answer under `draft=mode`, wall-timed, with its drafting figures."""
    t0 = time.perf_counter()
    result = ens.generate(prompt, temperature=0, max_tokens=max_tokens, draft=mode, draft_max=draft_max, leader=leader)
    seconds = time.perf_counter() - t0
    drafted = [r for r in result.rounds if r.decision == "drafted"]
    return {
        **asdict(Answer(result.text, result.stats.tokens, seconds)),
        "rounds": result.stats.rounds,
        "drafted_rounds": len(drafted),
        # The leader keeps the longest draft prefix it reproduces: a round's accepted tokens are its best drafter's.
        "accepted": sum(max((k for _, k in r.drafts.values()), default=0) for r in drafted),
        "drafting": result.stats.drafting,
    }


def run(plan: DraftingPlan, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole benchmark: load, warm up, every prompt through every system; the report, written to `out`."""
    prompts = {task: task_prompts(task, plan.per_task, plan.data) for task in plan.tasks}
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git(),
        "plan": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(plan).items()},
        "answer_reference": ANSWER_REFERENCE,
        "speed_reference": SPEED_REFERENCE,
    }
    with ExitStack() as stack:
        llama = stack.enter_context(Ensemble([plan.leader, *plan.drafters], prefix_cache_cells=0, threads=plan.threads))
        native = LlamaNative(member_path(llama.pick([plan.leader])[0]), plan.threads)
        stack.callback(native.close)
        families = {"llama": Family(llama_systems(llama, native, plan), llama.pick([plan.leader])[0], plan.per_task)}
        if plan.hf_prompts:
            hf = stack.enter_context(Ensemble(hf_specs(plan), prefix_cache_cells=0))
            families["hf"] = Family(hf_systems(hf, plan), hf.pick([HF_LEADER])[0], plan.hf_prompts)
        warm_up(families, log)
        report["answers"] = measure(prompts, families, plan.max_tokens, log)
    if plan.hf_prompts < plan.per_task:
        some = f"on the first {plan.hf_prompts} prompt(s) of each task only" if plan.hf_prompts else "left out"
        report["note"] = f"transformers rows {some}"
    report["summary"] = summarise(report["answers"], SPEED_REFERENCE)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


SystemFn = Callable[[str, int], dict[str, Any]]  # (prompt, max_tokens) -> an answer's figures
HF_LEADER, HF_DRAFTER = "hf-leader", "hf-drafter"


@dataclass(frozen=True)
class Family:
    """One engine's systems, in the order they run on a prompt; its leader (whose tokenizer compares answers);
    how many prompts per task it answers."""

    systems: dict[str, SystemFn]
    leader: Member
    prompts: int


def member_path(member: Member) -> Path:
    path = getattr(member, "path", None)
    if path is None:
        raise TypeError(f"{member.name}: not a llama.cpp member (no GGUF path)")
    return Path(path)


def hf_specs(plan: DraftingPlan) -> list[str]:
    return [f"transformers:{plan.hf_leader}#{HF_LEADER}", f"transformers:{plan.hf_drafter}#{HF_DRAFTER}"]


def _segfuse(ens: Ensemble, leader: str, mode: str, draft_max: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    return segfuse_answer(ens, leader, mode, prompt, max_tokens, draft_max)


def llama_systems(ens: Ensemble, native: LlamaNative, plan: DraftingPlan) -> dict[str, SystemFn]:
    systems: dict[str, SystemFn] = {"llama_alone": lambda p, n: asdict(native.answer("llama_alone", p, n))}
    for mode in MODES:
        systems[mode] = partial(_segfuse, ens, plan.leader, mode, plan.draft_max)
    systems["llama_pld"] = lambda p, n: asdict(native.answer("llama_pld", p, n))
    return systems


def hf_systems(ens: Ensemble, plan: DraftingPlan) -> dict[str, SystemFn]:
    leader, drafter = ens.pick([HF_LEADER])[0], ens.pick([HF_DRAFTER])[0]
    systems: dict[str, SystemFn] = {"hf_alone": lambda p, n: asdict(hf_answer(leader, None, p, n))}
    for mode in HF_MODES:
        systems[f"hf_{mode}"] = partial(_segfuse, ens, HF_LEADER, mode, plan.draft_max)
    systems["hf_assisted"] = lambda p, n: asdict(hf_answer(leader, drafter, p, n))
    return systems


def warm_up(families: dict[str, Family], log: Callable[[str], None]) -> None:
    """Every system once on a short answer: loads, allocations and first-call costs out of the first prompt."""
    t0 = time.perf_counter()
    for family in families.values():
        answer_all(family.systems, "Say hello.", WARM_TOKENS)
    log(f"warm-up: every system once on {WARM_TOKENS} tokens, {time.perf_counter() - t0:.1f}s")


def answer_all(systems: dict[str, SystemFn], prompt: str, max_tokens: int) -> dict[str, dict[str, Any]]:
    return {name: fn(prompt, max_tokens) for name, fn in systems.items()}


def measure(
    prompts: dict[str, list[str]], families: dict[str, Family], max_tokens: int, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Every prompt through every family's systems, one prompt at a time (paired); one record per answer."""
    answers: list[dict[str, Any]] = []
    for task, items in prompts.items():
        for index, prompt in enumerate(items):
            for name, family in families.items():
                if index >= family.prompts:
                    continue
                rows = answer_all(family.systems, prompt, max_tokens)
                answers.extend(compare(rows, family.leader, name, task, index))
                speeds = ", ".join(f"{s} {r['tokens'] / max(r['seconds'], 1e-9):.1f}" for s, r in rows.items())
                log(f"{task} #{index} {name} tokens/s: {speeds}")
    return answers


def compare(
    rows: dict[str, dict[str, Any]], leader: Member, family: str, task: str, index: int
) -> list[dict[str, Any]]:
    """The prompt's records: each answer with whether it equals its reference's, else the token index (the
    leader's tokenizer) where the two part."""
    records = []
    for system, row in rows.items():
        record = {"family": family, "task": task, "prompt": index, "system": system, **row}
        reference = ANSWER_REFERENCE.get(system)
        if reference is not None:
            record["reference"] = reference
            record["parts_at"] = parting(leader, row["text"], rows[reference]["text"])
            record["identical"] = record["parts_at"] is None
        records.append(record)
    return records


def parting(leader: Member, text: str, reference: str) -> int | None:
    """The first token index where two answers differ (None: identical)."""
    if text == reference:
        return None
    a, b = leader.tokenize_text(text) or [], leader.tokenize_text(reference) or []
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
