"""The likelihood study's tables from its records: the members alone and every pooling rule.

Systems: each member alone (per byte and whole), each rule with uniform weights, and each rule
with weights calibrated per task (on the study items: fitted on the other half of the task's
items, by index parity; on the confirmation items: fitted on all of the task's study items).
The rule is chosen on the study items (best macro average); the confirmation items are then
read once, against the member that did best on the study items::

    python -m segfuse.eval.likelihood_report docs/results/likelihood/study [docs/results/likelihood/confirm]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..likelihood import NORMS, RULES, Norm, Rule
from ..likelihood_weights import ScoredItem, fit_weights, item_from_record

Rows = list[tuple[int, ScoredItem, float]]  # (index, item, seconds of all members)
Split = dict[str, Rows]  # task -> its rows
System = Callable[[ScoredItem], bool]  # right or not on an item


def load_split(folder: str | Path, stop: int | None = None) -> tuple[Split, dict[str, float]]:
    """Records per task (sorted by index; only those below `stop`, where given), and each member's
    mean seconds per item."""
    split: Split = {}
    seconds: dict[str, list[float]] = {}
    for path in sorted(Path(folder).glob("*.jsonl")):
        rows = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if stop is not None and record["index"] >= stop:
                continue
            rows[record["index"]] = record
            for name, s in record["seconds"].items():
                seconds.setdefault(name, []).append(s)
        if rows:  # a task whose run has not written an item yet is left out
            split[path.stem] = [(i, item_from_record(r), sum(r["seconds"].values())) for i, r in sorted(rows.items())]
    return split, {n: sum(v) / len(v) for n, v in seconds.items()}


def member_system(name: str, norm: Norm) -> System:
    def right(item: ScoredItem) -> bool:
        only = Rule(norm=norm).fuse({name: item.members[name]})
        return item.right(only)

    return right


def outcomes(split: Split, study: Split | None) -> dict[str, dict[str, list[bool]]]:
    """system -> task -> right or not per item (in index order)."""
    names = list(next(iter(split.values()))[0][1].members)
    out: dict[str, dict[str, list[bool]]] = {}
    for task, rows in split.items():
        for name in names:
            for norm in NORMS:
                right = member_system(name, norm)
                out.setdefault(f"{name} ({norm})", {})[task] = [right(item) for _, item, _ in rows]
        for rule_name in RULES:
            rule = Rule.parse(rule_name)
            out.setdefault(f"{rule_name} uniform", {})[task] = [
                item.right(rule.fuse(item.members)) for _, item, _ in rows
            ]
            out.setdefault(f"{rule_name} calibrated", {})[task] = _calibrated(rule, rows, (study or {}).get(task))
        out.setdefault("member picked per task", {})[task] = _picked(names, rows, (study or {}).get(task))
    return out


def _picked(names: list[str], rows: Rows, study_rows: Rows | None) -> list[bool]:
    """Right or not for the member (and unit) that did best on the task's study rows (else on the other
    half of its rows, by index parity): selection without pooling, the baseline calibrated weights face."""
    systems = [member_system(n, norm) for n in names for norm in NORMS]

    def best(on: list[ScoredItem]) -> System:
        return max(systems, key=lambda right: sum(right(item) for item in on))

    if study_rows is not None:
        chosen = best([item for _, item, _ in study_rows])
        return [chosen(item) for _, item, _ in rows]
    return [best([it for i, it, _ in rows if i % 2 != index % 2])(item) for index, item, _ in rows]


def _calibrated(rule: Rule, rows: Rows, study_rows: Rows | None) -> list[bool]:
    """Right or not under weights fitted per task: on the study rows, else by parity cross-fitting."""
    if study_rows is not None:
        weights = fit_weights(rule, [item for _, item, _ in study_rows])
        fitted = Rule(rule.pool, rule.norm, weights)
        return [item.right(fitted.fuse(item.members)) for _, item, _ in rows]
    result = []
    for index, item, _ in rows:
        others = [it for i, it, _ in rows if i % 2 != index % 2]
        fitted = Rule(rule.pool, rule.norm, fit_weights(rule, others)) if others else rule
        result.append(item.right(fitted.fuse(item.members)))
    return result


def macro(per_task: Mapping[str, list[bool]]) -> float:
    return sum(sum(v) / len(v) for v in per_task.values()) / len(per_task)


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test p-value (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / (1 << n))


def paired(a: Mapping[str, list[bool]], b: Mapping[str, list[bool]]) -> dict[str, tuple[int, int]]:
    """Per task (and "all"): items `a` got right and `b` wrong, and the reverse."""
    out = {}
    for task in a:
        won = sum(x and not y for x, y in zip(a[task], b[task]))
        lost = sum(y and not x for x, y in zip(a[task], b[task]))
        out[task] = (won, lost)
    out["all"] = (sum(w for w, _ in out.values()), sum(lo for _, lo in out.values()))
    return out


def choose(results: Mapping[str, Mapping[str, list[bool]]]) -> tuple[str, str]:
    """(the best pooled system, the best member alone) by macro average; the first listed wins a tie."""
    pooled = [s for s in results if s.endswith(("uniform", "calibrated"))]
    alone = [s for s in results if s not in pooled and s != "member picked per task"]
    return max(pooled, key=lambda s: macro(results[s])), max(alone, key=lambda s: macro(results[s]))


def table(results: Mapping[str, Mapping[str, list[bool]]], marks: Mapping[str, str]) -> str:
    """A markdown table: right items per task and the macro average per system."""
    tasks = list(next(iter(results.values())))
    head = "| system | " + " | ".join(_short(t) for t in tasks) + " | macro % |"
    lines = [head, "|" + "---|" * (len(tasks) + 2)]
    for system, per_task in results.items():
        cells = [f"{sum(per_task[t])}/{len(per_task[t])}" for t in tasks]
        lines.append(f"| {system}{marks.get(system, '')} | " + " | ".join(cells) + f" | {100 * macro(per_task):.1f} |")
    return "\n".join(lines)


def _short(task: str) -> str:
    """A column label: the task's name without its subtask, except where two tasks share it (wikihow)."""
    head, _, sub = task.partition("-")
    if head == "goal_step_wikihow":
        return "wikihow " + sub.split("_")[0]
    return head.replace("_", " ")[:18]


def pairing_lines(a: Mapping[str, list[bool]], b: Mapping[str, list[bool]]) -> str:
    lines = ["| task | won | lost | sign test p |", "|---|---|---|---|"]
    for task, (won, lost) in paired(a, b).items():
        lines.append(
            f"| {_short(task) if task != 'all' else '**all**'} | {won} | {lost} | {sign_test(won, lost):.3f} |"
        )
    return "\n".join(lines)


def report(study_dir: str, confirm_dir: str | None = None, study_stop: int | None = None) -> str:
    study, seconds = load_split(study_dir, study_stop)
    results = outcomes(study, None)
    chosen, best = choose(results)
    parts = [f"## Study ({study_dir})", *_section(results, seconds, chosen, best, "")]
    if confirm_dir:
        confirm, c_seconds = load_split(confirm_dir)
        c_results = outcomes(confirm, {t: study[t] for t in confirm})
        parts += [f"\n## Confirmation ({confirm_dir})", *_section(c_results, c_seconds, chosen, best, " on study")]
    return "\n".join(parts)


def _section(
    results: Mapping[str, Mapping[str, list[bool]]], seconds: Mapping[str, float], chosen: str, best: str, where: str
) -> list[str]:
    """A split's table (`chosen` and `best` marked, as picked `where`), their pairing, the seconds per item."""
    return [
        table(results, {chosen: f" ← chosen{where}", best: f" ← best member{where}"}),
        f"\n{chosen} vs {best}:\n",
        pairing_lines(results[chosen], results[best]),
        "\nseconds per item: "
        + ", ".join(f"{n} {s:.2f}" for n, s in seconds.items())
        + f"; all members {sum(seconds.values()):.2f}",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study")
    parser.add_argument("confirm", nargs="?")
    parser.add_argument("--study-stop", type=int, default=None, help="read study items below this index only")
    args = parser.parse_args(argv)
    print(report(args.study, args.confirm, args.study_stop))


if __name__ == "__main__":
    main()
