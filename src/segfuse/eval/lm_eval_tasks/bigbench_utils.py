"""Hooks of the offline BIG-bench multiple-choice task configs (``segfuse_bigbench_*``).

The items come from ``../shared/data/bigbench`` through :mod:`segfuse.eval.bigbench`, so lm-eval
scores exactly the contexts and choices the likelihood study scores. Paths are relative to the
working directory: run from the project root.
"""

from __future__ import annotations

from typing import Any

from segfuse.eval.bigbench import DATA_DIR, items


def load(task: str, start: int = 0, stop: int | None = None, data_dir: str = str(DATA_DIR), **_: Any) -> dict[str, Any]:
    """The task's examples as one ``test`` split of flat rows (context, choices, gold)."""
    import datasets

    rows = [
        {"index": i.index, "context": i.context, "choices": list(i.choices), "gold": i.correct[0]}
        for i in items(task, start, stop, data_dir)
    ]
    return {"test": datasets.Dataset.from_list(rows)}


def doc_to_text(doc: dict[str, Any]) -> str:
    return str(doc["context"])


def doc_to_choice(doc: dict[str, Any]) -> list[str]:
    return list(doc["choices"])


def doc_to_target(doc: dict[str, Any]) -> int:
    return int(doc["gold"])
