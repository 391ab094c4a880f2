"""Structured output on GSM8K questions: unconstrained vs constrained, leader alone vs fused.

``python -m segfuse.bench.serve.structured --items 50 [--offset 0] [--out runs/structured.json]``: each
GSM8K test question (../shared/data) becomes an extraction prompt: "return the quantities it gives
and what it asks, as JSON with keys numbers and asks". Systems, greedy, taking turns on each item:

- ``leader``: the leader alone (the default options), no constraint: the prompt alone asks for JSON;
- ``leader+schema``: the same under the JSON schema;
- ``fused``: plain fusion (every member drafts and votes), no constraint;
- ``fused+schema``: the same, every member drafting under its mask.

(The default options are the leader alone, so "the default, constrained" is ``leader+schema``.)

Per system: the share of answers that parse and validate, the share whose ``numbers`` are exactly the
numbers written in digits in the question (the reference, read with a regular expression; numbers
written as words may be listed too), and the seconds and tokens per answer. Prints a table and writes every answer to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

from ...constraints import Constraint
from ...ensemble import Ensemble
from ...eval.tasks import get_task
from ..common.machine import git, machine


def object_schema(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """The JSON schema of an object with these `properties` and no others, all of them required unless
    `required` names fewer."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": list(properties) if required is None else required,
        "properties": properties,
    }


SCHEMA = object_schema(
    {
        "numbers": {"type": "array", "items": {"type": "number"}, "maxItems": 12},
        "asks": {"type": "string", "maxLength": 200},
    }
)
INSTRUCTION = (
    'Read the problem below. Do not solve it. Return only a JSON object with two keys: "numbers", '
    'the list of every number the problem states, in order, and "asks", what the problem asks for, '
    "in a few words.\n\nProblem: "
)
SYSTEMS = {
    "leader": ({}, False),
    "leader+schema": ({}, True),
    "fused": ({"gate": None, "accept_margin": None}, False),
    "fused+schema": ({"gate": None, "accept_margin": None}, True),
}
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


def reference_numbers(question: str) -> list[float]:
    """The numbers a question writes in digits (thousands separators dropped)."""
    return [float(m.replace(",", "")) for m in NUMBER.findall(question) if m.replace(",", "").strip(".")]


def judge(text: str, question: str, constraint: Constraint) -> dict[str, Any]:
    """Whether an answer parses, validates, and lists the question's numbers exactly."""
    parsed = None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        pass
    valid = parsed is not None and constraint.check(text) is None
    listed = [float(n) for n in parsed.get("numbers", [])] if valid and isinstance(parsed, dict) else []
    found = valid and all(listed.count(n) >= need for n, need in _counts(reference_numbers(question)).items())
    return {"parses": parsed is not None, "valid": valid, "numbers_found": bool(found)}


def _counts(values: list[float]) -> dict[float, int]:
    return {v: values.count(v) for v in set(values)}


def run(items: int, offset: int, max_tokens: int, threads: int | None = None) -> dict[str, Any]:
    # the bare question: the task's own prompt asks for a worked solution
    questions = [item.prompt.split("Question: ", 1)[-1] for item in get_task("gsm8k").load(offset=offset, limit=items)]
    constraint = Constraint.json_schema(SCHEMA)
    code = git()  # the code that runs: read before, not after (commits may land meanwhile)
    rows: list[dict[str, Any]] = []
    member_options: dict[str, Any] = {"threads": threads} if threads else {}
    with Ensemble(**member_options) as ensemble:
        ensemble.generate("Say hi.", max_tokens=4, temperature=0)  # warm-up
        for index, question in enumerate(questions, offset):
            for system, (options, constrained) in SYSTEMS.items():
                t0 = time.perf_counter()
                result = ensemble.generate(
                    INSTRUCTION + question,
                    temperature=0,
                    max_tokens=max_tokens,
                    constraint=constraint if constrained else None,
                    **options,
                )
                seconds = time.perf_counter() - t0
                rows.append(
                    {
                        "item": index,
                        "system": system,
                        "text": result.text,
                        "seconds": seconds,
                        "tokens": result.stats.tokens,
                        "finish": result.stats.finish_reason,
                        **judge(result.text, question, constraint),
                    }
                )
            print(
                f"gsm8k {index}: "
                + ", ".join(
                    f"{r['system']} {'ok' if r['valid'] else 'INVALID'} {r['seconds']:.1f}s"
                    for r in rows[-len(SYSTEMS) :]
                )
            )
    return {
        "machine": machine(),
        "git": code,
        "items": f"gsm8k test {offset}-{offset + items - 1}",
        "max_tokens": max_tokens,
        "summary": summarise(rows),
        "rows": rows,
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    table = {}
    for system in SYSTEMS:
        mine = [r for r in rows if r["system"] == system]
        table[system] = {
            "answers": len(mine),
            "valid": sum(r["valid"] for r in mine) / len(mine),
            "numbers_found": sum(r["numbers_found"] for r in mine) / len(mine),
            "seconds_mean": statistics.fmean(r["seconds"] for r in mine),
            "ms_per_token": 1000 * sum(r["seconds"] for r in mine) / max(1, sum(r["tokens"] for r in mine)),
            "tokens_mean": statistics.fmean(r["tokens"] for r in mine),
            "cut_by_length": sum(r["finish"] == "length" for r in mine),
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=50)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="threads per member (1 for two runs side by side)")
    parser.add_argument("--out", default="runs/structured.json")
    args = parser.parse_args()
    report = run(args.items, args.offset, args.max_tokens, args.threads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for system, row in report["summary"].items():
        print(
            f"{system:14} valid {row['valid']:.0%}  numbers found {row['numbers_found']:.0%}  "
            f"{row['seconds_mean']:.2f} s  {row['tokens_mean']:.0f} tokens  {row['ms_per_token']:.0f} ms/token  cut {row['cut_by_length']}"
        )


if __name__ == "__main__":
    main()
