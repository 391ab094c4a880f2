"""Evaluation tasks: loading local data, prompts and scoring.

GSM8K (exact match on the final number)
    Prompt (zero-shot chain of thought)::

        Solve the following math problem step by step. At the end, write the final
        answer on its own line as "The answer is N." where N is a number.

        Question: <question>

    Reference: the number after ``#### `` in the dataset's answer.
    Extraction rule (:func:`extract_number`), first that applies:
    1. the last ``\\boxed{...}`` (LaTeX);
    2. the last "answer is N" / "answer: N" / "#### N" (case-insensitive, an
       optional ``$`` or ``=`` in between);
    3. the last number anywhere in the text.
    Numbers are normalised: thousands commas and ``$``/``%`` dropped, a trailing
    period dropped, ``12.0`` equals ``12``, fractions ``a/b`` evaluated. Correct
    means the extracted number equals the reference (|diff| < 1e-6).

IFEval (instruction following)
    The prompt is sent as is. Scoring is lm-evaluation-harness's own IFEval
    implementation (``lm_eval.tasks.ifeval``): prompt-level and
    instruction-level accuracy, strict and loose. See :mod:`.nltk_offline` for
    how its sentence tokenizer data is provided without a download.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError
from ..types import Message

DATA_ROOT_ENV = "SEGFUSE_EVAL_DATA"


@dataclass(frozen=True)
class Item:
    """One evaluation prompt: a stable id, the user message and what scoring needs."""

    id: str
    index: int
    prompt: str
    reference: Any


@dataclass(frozen=True)
class Task:
    """A benchmark: where its data is, how it is prompted and scored."""

    name: str
    default_data: str  # relative to the project root's parent data folder
    default_max_tokens: int
    primary: str  # the metric shown in the progress bar and plots
    metrics: tuple[str, ...]
    parse: Callable[[dict[str, Any], int], Item]
    score: Callable[[Item, str], dict[str, Any]]
    instruction_metrics: tuple[str, ...] = field(default=())  # per-instruction lists, pooled in reports

    @classmethod
    def one_metric(
        cls,
        name: str,
        default_data: str,
        default_max_tokens: int,
        metric: str,
        parse: Callable[[dict[str, Any], int], Item],
        score: Callable[[Item, str], dict[str, Any]],
    ) -> Task:
        """A task scored by one metric, its primary one."""
        return cls(name, default_data, default_max_tokens, metric, (metric,), parse, score)

    def messages(self, item: Item) -> list[Message]:
        return [Message("user", item.prompt)]

    def load(self, path: str | Path | None = None, *, offset: int = 0, limit: int | None = None) -> list[Item]:
        """Items [offset, offset+limit) of the task's JSONL file."""
        if not path and not self.default_data:
            raise InvalidRequestError(
                f"the {self.name} task has no data of its own", "pass --data PATH to a JSONL file"
            )
        data = Path(path) if path else default_data_path(self.default_data)
        if not data.is_file():
            raise InvalidRequestError(f"no data file at {data}", "pass --data PATH to the task's JSONL file")
        items: list[Item] = []
        with data.open(encoding="utf-8") as handle:
            for index, line in enumerate(handle):
                if index < offset or not line.strip():
                    continue
                if limit is not None and len(items) >= limit:
                    break
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InvalidRequestError(
                        f"{data} line {index + 1} is not JSON: {exc.msg}", "one JSON object per line"
                    ) from None
                items.append(self.parse(row, index))
        return items


def default_data_path(relative: str) -> Path:
    """``../shared/data/<relative>`` from the project root (or $SEGFUSE_EVAL_DATA/<relative>)."""
    import os

    root = os.environ.get(DATA_ROOT_ENV)
    if root:
        return Path(root) / relative
    project = Path(__file__).resolve().parents[3]  # src/segfuse/eval/tasks.py -> project root
    candidates = [project.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    for base in candidates:
        if (base / relative).is_file():
            return base / relative
    return candidates[0] / relative


# --- GSM8K -------------------------------------------------------------------

GSM8K_PROMPT = (
    "Solve the following math problem step by step. At the end, write the final answer on its own line "
    'as "The answer is N." where N is a number.\n\nQuestion: {question}'
)

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?(?:\s?/\s?\d+(?:\.\d+)?)?"
_NUMBER_RE = re.compile(_NUMBER)
_ANSWER_RE = re.compile(r"(?:answer\s*(?:is|:)|####)\s*[:=]?\s*\**\s*(" + _NUMBER + ")", re.IGNORECASE)
_BOXED_RE = re.compile(r"\\boxed\s*\{([^{}]*)\}")


def parse_number(text: str) -> float | None:
    """A number written in `text` ("1,234", "$5.50", "-3", "12.0", "3/4"), or None."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace("%", "").replace(" ", "")
    cleaned = cleaned.rstrip(".")
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)(?:/(\d+(?:\.\d+)?))?", cleaned)
    if not match:
        return None
    try:
        if match.group(2):
            denominator = Fraction(match.group(2))
            return float(Fraction(match.group(1)) / denominator) if denominator else None
        return float(Fraction(match.group(1)))
    except (ValueError, ZeroDivisionError, OverflowError):  # OverflowError: a looping model's endless digits
        return None


def extract_number(text: str) -> float | None:
    """The model's final number by the documented rule (module docstring)."""
    for boxed in reversed(_BOXED_RE.findall(text)):
        numbers = _NUMBER_RE.findall(boxed)
        if numbers and (value := parse_number(numbers[-1])) is not None:
            return value
    for found in reversed(_ANSWER_RE.findall(text)):
        if (value := parse_number(found)) is not None:
            return value
    for found in reversed(_NUMBER_RE.findall(text)):
        if (value := parse_number(found)) is not None:
            return value
    return None


def gsm8k_reference(answer: str) -> float:
    """The number after ``#### `` in a GSM8K solution."""
    tail = answer.rsplit("####", 1)[-1]
    value = parse_number(tail)
    if value is None:
        raise ValueError(f"no reference number in {tail!r}")
    return value


def _gsm8k_parse(row: dict[str, Any], index: int) -> Item:
    return Item(
        id=f"gsm8k-{index}",
        index=index,
        prompt=GSM8K_PROMPT.format(question=row["question"].strip()),
        reference=gsm8k_reference(row["answer"]),
    )


def score_gsm8k(item: Item, output: str) -> dict[str, Any]:
    predicted = extract_number(output)
    correct = predicted is not None and abs(predicted - item.reference) < 1e-6
    return {"correct": correct, "exact_match": correct, "predicted": predicted, "reference": item.reference}


GSM8K = Task.one_metric("gsm8k", "gsm8k/test_first1000.jsonl", 512, "exact_match", _gsm8k_parse, score_gsm8k)


# --- IFEval ------------------------------------------------------------------

IFEVAL_PROMPT_METRICS = ("prompt_level_strict_acc", "prompt_level_loose_acc")
IFEVAL_INST_METRICS = ("inst_level_strict_acc", "inst_level_loose_acc")


def _ifeval_parse(row: dict[str, Any], index: int) -> Item:
    doc = {
        "key": row["key"],
        "prompt": row["prompt"],
        "instruction_id_list": list(row["instruction_id_list"]),
        "kwargs": list(row["kwargs"]),
    }
    return Item(id=f"ifeval-{row['key']}", index=index, prompt=row["prompt"], reference=doc)


def score_ifeval(item: Item, output: str) -> dict[str, Any]:
    """lm-evaluation-harness's IFEval checks on one response."""
    from .nltk_offline import ensure_punkt

    ensure_punkt()  # before lm_eval's ifeval module is imported: it looks for punkt_tab
    from lm_eval.tasks.ifeval.utils import process_results

    # lm_eval draws a random letter where an item's letter is not a-z (e.g. "!"), and random words and counts
    # where kwargs leave them out: seed per item, so one answer always gets one score (global state restored).
    state = random.getstate()
    random.seed(item.id)
    try:
        result = process_results(item.reference, [output])
    finally:
        random.setstate(state)
    scores: dict[str, Any] = {k: bool(result[k]) for k in IFEVAL_PROMPT_METRICS}
    scores.update({k: [bool(v) for v in result[k]] for k in IFEVAL_INST_METRICS})
    scores["correct"] = scores["prompt_level_strict_acc"]
    return scores


IFEVAL = Task(
    name="ifeval",
    default_data="ifeval/input_data_dev.jsonl",
    default_max_tokens=512,
    primary="prompt_level_strict_acc",
    metrics=IFEVAL_PROMPT_METRICS + IFEVAL_INST_METRICS,
    parse=_ifeval_parse,
    score=score_ifeval,
    instruction_metrics=IFEVAL_INST_METRICS,
)

TASKS: dict[str, Task] = {t.name: t for t in (GSM8K, IFEVAL)}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise InvalidRequestError(f"unknown task {name!r}", f"choose one of {', '.join(TASKS)}") from None


# --- the user's own prompts ----------------------------------------------------------------

CHECKERS = ("number", "contains", "regex", "python:MODULE:FUNCTION")


def _check_function(checker: str) -> Callable[[dict[str, Any], str], bool]:
    """The rule that says whether an output answers a JSONL row (see :func:`jsonl_task`)."""
    if checker == "number":
        return lambda row, out: (got := extract_number(out)) is not None and abs(got - _number(row)) < 1e-6
    if checker == "contains":
        return lambda row, out: str(row["answer"]).strip().lower() in out.lower()
    if checker == "regex":
        return lambda row, out: re.search(str(row["answer"]), out) is not None
    if checker.startswith("python:") and checker.count(":") == 2:
        import importlib
        import sys

        _, module, function = checker.split(":")
        sys.path.insert(0, str(Path.cwd()))
        try:
            fn = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError) as exc:
            raise InvalidRequestError(
                f"cannot load the checker {checker}: {exc}",
                "give python:MODULE:FUNCTION importable from the current folder",
            ) from None
        return lambda row, out: bool(fn(row, out))
    raise InvalidRequestError(f"unknown checker {checker!r}", f"choose one of {', '.join(CHECKERS)}")


def _number(row: dict[str, Any]) -> float:
    value = parse_number(str(row["answer"]))
    if value is None:
        raise InvalidRequestError(f"the answer {row['answer']!r} is not a number", "the number checker needs numbers")
    return value


def jsonl_task(checker: str | None) -> Task:
    """A task of the user's own: a JSONL file, one ``{"prompt": ..., "answer": ...}`` per line.

    `checker` says when an output is right: ``number`` (the output's final number,
    found as for GSM8K, equals ``answer``), ``contains`` (``answer`` appears in
    it, ignoring case), ``regex`` (``answer`` is a regular expression that
    matches it), or ``python:MODULE:FUNCTION`` (``FUNCTION(row, output) -> bool``,
    importable from the current folder; the row is the whole JSON object).
    """
    if not checker:
        raise InvalidRequestError(
            "a JSONL task needs a checker to say which answers are right",
            f"add --checker, one of {', '.join(CHECKERS)}",
        )
    check = _check_function(checker)

    def parse(row: dict[str, Any], index: int) -> Item:
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequestError(f'line {index + 1} has no "prompt" text', 'write {"prompt": ..., "answer": ...}')
        if not checker.startswith("python:") and "answer" not in row:
            raise InvalidRequestError(
                f'line {index + 1} has no "answer" for the {checker} checker', 'write {"prompt": ..., "answer": ...}'
            )
        return Item(id=str(row.get("id", f"jsonl-{index}")), index=index, prompt=prompt, reference=row)

    def score(item: Item, output: str) -> dict[str, Any]:
        correct = check(item.reference, output)
        return {"correct": correct, "accuracy": correct}

    return Task.one_metric("jsonl", "", 256, "accuracy", parse, score)
