"""BIG-bench multiple-choice tasks from their ``task.json`` files, as cloze items.

An item's context is the task's own framing (``task_prefix``, ``example_input_prefix``, the
input, ``example_output_prefix``; BIG-bench's defaults ``"\\nQ: "`` and ``"\\nA: "``), with
no choices appended; each choice is a continuation of it. The study, ``segfuse score`` and
the lm-eval task configs read items through here, so all of them score the same texts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

DATA_DIR = Path("../shared/data/bigbench")
TASKS: tuple[str, ...] = (
    "abstract_narrative_understanding-4_distractors",
    "arithmetic-2_digit_addition",
    "date_understanding",
    "disambiguation_qa",
    "discourse_marker_prediction",
    "elementary_math_qa-question_only",
    "goal_step_wikihow-goal_inference",
    "goal_step_wikihow-step_inference",
    "movie_recommendation",
    "social_iqa",
)


@dataclass(frozen=True)
class Item:
    """One multiple-choice example: the context, its choices, and the indices of the right ones."""

    task: str
    index: int
    context: str
    choices: tuple[str, ...]
    correct: tuple[int, ...]


@cache
def load_task(task: str, data_dir: str | Path = DATA_DIR) -> dict[str, Any]:
    path = Path(data_dir) / f"{task}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no BIG-bench task file {path} (tasks: {', '.join(TASKS)})")
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def context_of(task: dict[str, Any], example: dict[str, Any]) -> str:
    """The cloze context of one example under its task's framing."""
    text: str = (
        task.get("task_prefix", "")
        + task.get("example_input_prefix", "\nQ: ")
        + example["input"]
        + task.get("example_output_prefix", "\nA: ")
    )
    return text.lstrip("\n")


def items(task: str, start: int = 0, stop: int | None = None, data_dir: str | Path = DATA_DIR) -> list[Item]:
    """Examples ``start`` to ``stop`` (exclusive) of `task`, in file order."""
    data = load_task(task, data_dir)
    out = []
    for index, example in enumerate(data["examples"][start:stop], start):
        choices = tuple(example["target_scores"])
        correct = tuple(i for i, c in enumerate(choices) if example["target_scores"][c] == 1)
        out.append(Item(task, index, context_of(data, example), choices, correct))
    return out


def doc_to_text(doc: dict[str, Any], task: dict[str, Any]) -> str:
    """lm-eval's view of an example (a row of ``examples``)."""
    return context_of(task, doc)
