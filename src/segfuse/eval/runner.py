"""Running systems over a task's items into a resumable JSONL file.

Layout of an output folder::

    DIR/<task>.jsonl      one JSON object per (item, system), appended as it finishes
    DIR/<task>.run.json   the settings and members of the run (a resumed run must match)
    DIR/report.md, DIR/*.png   written by :mod:`.report`

Items run in order and, per item, every system runs before the next item, so
at any moment all systems cover the same items (plus at most one).
Rerunning with the same folder skips every (item, system) already recorded.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError, SegfuseError
from .baselines import MemberAnswer
from .systems import MEMBER_PREFIX, ItemContext, RunSettings, get_system, resolve_systems
from .tasks import Task, get_task


def results_path(out_dir: Path, task: str) -> Path:
    return out_dir / f"{task}.jsonl"


def read_records(path: Path) -> list[dict[str, Any]]:
    """All complete records of a JSONL file (a line cut by a crash is ignored)."""
    records: list[dict[str, Any]] = []
    if not path.is_file():
        return records
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _check_recorded(path: Path, key: str, value: Any) -> None:
    if path.is_file():
        previous = json.loads(path.read_text(encoding="utf-8")).get(key)
        if previous != value:
            raise InvalidRequestError(
                f"{path.parent} holds a run with other {key}: {previous} (now {value})",
                "use another --out folder, or the same options as before",
            )


def _planned_systems(systems: str | Sequence[str], members: Sequence[str] | None) -> list[str] | None:
    """The systems a run will have, from member names before loading (None if unsure)."""
    from ..models import DEFAULT_MODELS

    try:
        return resolve_systems(systems, list(members) if members else list(DEFAULT_MODELS))
    except InvalidRequestError:
        return None


def _check_run_file(path: Path, config: dict[str, Any]) -> None:
    """A resumed run must use the same settings and members as the recorded one."""
    if path.is_file():
        for key in ("settings", "members"):
            _check_recorded(path, key, config[key])
        previous = json.loads(path.read_text(encoding="utf-8"))
        config = {**previous, "systems": sorted(set(previous.get("systems", [])) | set(config["systems"]))}
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _recorded(settings: RunSettings) -> dict[str, Any]:
    """Settings as recorded in run.json; unused optional fields are left out so older runs still match."""
    unused = {"stop": (), "hedge_persist": False, "options": {}}
    return {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in asdict(settings).items()
        if not (k in unused and v == unused[k])
    }


def carried_weights(records: Sequence[dict[str, Any]], first_pending: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per system, the weights it ended with on its latest item before its first pending one.

    That is where a run with ``hedge_persist`` left off, so a resumed run goes on
    from the same prior as an uninterrupted one.
    """
    latest: dict[str, tuple[int, dict[str, float]]] = {}
    for r in records:
        system, index = r["system"], r["index"]
        if (
            r.get("weights")
            and system in first_pending
            and latest.get(system, (-1,))[0] <= index < first_pending[system]
        ):
            latest[system] = (index, r["weights"])
    return {system: weights for system, (_, weights) in latest.items()}


def run_eval(
    task_name: str | Task,
    out_dir: str | Path,
    *,
    systems: str | Sequence[str] = "specfuse,rerank,members",
    members: Sequence[str] | None = None,
    limit: int | None = None,
    offset: int = 0,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int | None = 0,
    window: int = 10,
    data: str | Path | None = None,
    progress: bool = True,
    member_options: dict[str, Any] | None = None,
    hedge_persist: bool = False,
    top_p: float | None = None,
    stop: tuple[str, ...] = (),
    options: dict[str, Any] | None = None,
) -> Path:
    """Evaluate `systems` on items [offset, offset+limit) of a task; return the JSONL path."""
    from ..ensemble import Ensemble  # loads llama.cpp: only when a run really starts

    task = task_name if isinstance(task_name, Task) else get_task(task_name)
    items = task.load(data, offset=offset, limit=limit)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = RunSettings(
        max_tokens=max_tokens or task.default_max_tokens,
        temperature=temperature,
        top_p=top_p if top_p is not None else 1.0 if temperature <= 0 else 0.9,
        seed=seed,
        window=window,
        stop=stop,
        hedge_persist=hedge_persist,
        options=dict(options or {}),
    )
    path = results_path(out, task.name)
    previous = read_records(path)
    done = {(r["id"], r["system"]) for r in previous}
    run_file = out / f"{task.name}.run.json"
    _check_recorded(run_file, "settings", _recorded(settings))  # fail before loading any model
    planned = _planned_systems(systems, members)
    if planned and all((item.id, name) in done for item in items for name in planned):
        return path  # everything is recorded already: nothing to load
    # Systems take turns on each item: none may read its prompt from the cache the one before filled.
    member_options = {"prefix_cache_cells": 0, **(member_options or {})}
    with Ensemble(list(members) if members else None, **member_options) as ensemble:
        names = resolve_systems(systems, ensemble.names)
        _check_run_file(run_file, _run_record(task, settings, ensemble.names, names, data))
        pending = [(item, name) for item in items for name in names if (item.id, name) not in done]
        _run_pending(task, pending, ensemble, settings, previous, path, progress, {i.id for i in items})
    return path


def _run_record(
    task: Task, settings: RunSettings, members: list[str], systems: list[str], data: str | Path | None
) -> dict[str, Any]:
    """What the run file keeps of a run: the task, its settings, members and systems, where its data came from,
    when and where it started."""
    return {
        "task": task.name,
        "settings": _recorded(settings),
        "members": members,
        "systems": systems,
        "data": str(data or task.default_data),
        "started": datetime.now(UTC).isoformat(),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()}".strip(),
    }


def _run_pending(
    task: Task,
    pending: Sequence[tuple[Any, str]],
    ensemble: Any,
    settings: RunSettings,
    previous: Sequence[dict[str, Any]],
    path: Path,
    progress: bool,
    ids: set[str],
) -> None:
    """Run each pending (item, system) in order, appending its record as soon as it is scored."""
    bar = _progress(len(pending), task.name, enabled=progress)
    running = _RunningAccuracy(list(previous), ids)
    first_pending: dict[str, int] = {}
    for item, name in pending:
        first_pending.setdefault(name, item.index)
    carried = carried_weights(previous, first_pending)
    context, context_item = ItemContext(ensemble, carried=carried), ""
    with path.open("a", encoding="utf-8") as sink:
        for item, name in pending:
            if context_item != item.id:  # answers kept for rerank belong to one item
                context, context_item = ItemContext(ensemble, carried=carried), item.id
                context.answers.update(recorded_answers(previous, item.id))
            context.system = name
            record = run_one(task, item, name, context, settings)
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            sink.flush()
            running.add(record)
            bar.update(1)
            bar.set_postfix_str(running.summary(), refresh=False)
    bar.close()


def recorded_answers(records: Sequence[dict[str, Any]], item_id: str) -> dict[str, MemberAnswer]:
    """Member-alone answers already recorded for an item, so a resumed ``rerank`` reuses them.

    The run file guarantees the same settings and members, so the recorded
    answer is the one the member would write again; its measured cost counts.
    """
    answers: dict[str, MemberAnswer] = {}
    for r in records:
        if r["id"] == item_id and r["system"].startswith(MEMBER_PREFIX) and "error" not in r:
            name = r["system"][len(MEMBER_PREFIX) :]
            answers[name] = MemberAnswer(
                name,
                r["output"],
                r.get("tokens", 0),
                r.get("member_calls", 0),
                r.get("ttft_s"),
                r.get("total_s", 0.0),
                r.get("finish_reason", ""),
            )
    return answers


def run_one(task: Task, item: Any, system: str, context: ItemContext, settings: RunSettings) -> dict[str, Any]:
    """Run one system on one item and score it: one JSONL record."""
    record: dict[str, Any] = {"task": task.name, "id": item.id, "index": item.index, "system": system}
    started = time.perf_counter()
    try:
        output = get_system(system)(context, task.messages(item), settings)
    except SegfuseError as exc:  # e.g. a prompt too long for one member: record it, go on
        record.update(output="", correct=False, error=exc.message, total_s=time.perf_counter() - started)
        return record
    record.update(
        output=output.text,
        **task.score(item, output.text),
        ttft_s=output.ttft_s,
        total_s=output.total_s,
        member_calls=output.member_calls,
        tokens=output.tokens,
        rounds=output.rounds,
        wins=output.wins,
        weights=output.weights,
        finish_reason=output.finish_reason,
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        seed=settings.seed,
    )
    if output.extra:
        record["selection"] = output.extra
    return record


class _RunningAccuracy:
    """Correct/total per system over this run's items, for the progress bar."""

    def __init__(self, records: list[dict[str, Any]], ids: set[str]) -> None:
        self.counts: dict[str, list[int]] = {}
        for record in records:
            if record["id"] in ids:
                self.add(record)

    def add(self, record: dict[str, Any]) -> None:
        count = self.counts.setdefault(record["system"], [0, 0])
        count[0] += bool(record.get("correct"))
        count[1] += 1

    def summary(self) -> str:
        return " ".join(f"{_short(s)} {c / n:.0%}/{n}" for s, (c, n) in self.counts.items() if n)


def _short(system: str) -> str:
    return system.split(":", 1)[-1].split("-")[0] if system.startswith("member:") else system


def _progress(total: int, label: str, enabled: bool) -> Any:  # tqdm has no type information
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="run", disable=not enabled, dynamic_ncols=True)
