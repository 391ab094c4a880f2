"""`segfuse calibrate`: choose the engine's settings for the user's own members and prompts.

The leader (the largest member) answers alone, and each setting of a small grid
answers the same items, in the same process, item by item (the evaluation
harness: resumable, a progress bar). The profile keeps the cheapest setting
right on more items than the leader; if none is, the leader alone
(``accept_margin = 0``), the cheapest setting that does not lose. It is a
TOML file (``profiles.py``) that ``generate``, ``chat``, ``serve`` and
``eval`` load with ``--profile``; its ``[calibration]`` table records the
figures the choice was made on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from statistics import fmean
from typing import Any

from ..errors import InvalidRequestError
from ..profiles import write_profile
from .runner import read_records, run_eval
from .systems import FUSION_PREFIX, MEMBER_PREFIX, parse_fusion
from .tasks import Task

MIN_ITEMS = 10
# The screened settings (docs/results.md): the leader verifies at a few margins, under the default gate.
DEFAULT_GRID = (
    "gate=0.5/accept_margin=1.0",
    "gate=0.5/accept_margin=2.0",
    "gate=0.5/accept_margin=3.0",
    "gate=0.5/accept_margin=none",
)
LEADER_ALONE = "accept_margin=0"


@dataclass
class Setting:
    """One setting's figures against the leader, on the items both answered."""

    spec: str  # the grid entry (KEY=VALUE/...), or "leader alone"
    correct: int
    items: int
    only_this: int  # items this setting got right and the leader did not
    only_leader: int
    time_ratio: float  # mean time per answer over the leader's, same process
    leader_correct: int  # the leader's correct answers on the same items


def calibrate(
    task: Task,
    out: str | Path,
    *,
    members: Sequence[str] | None,
    grid: Sequence[str] = DEFAULT_GRID,
    data: str | None = None,
    offset: int = 0,
    limit: int | None = 40,
    max_tokens: int | None = None,
    member_options: dict[str, Any] | None = None,
    progress: bool = True,
    leader: str | None = None,
) -> tuple[Path, list[Setting], Setting]:
    """Run the leader and the grid on the items; write the profile; return it, every setting, the choice."""
    items = task.load(data, offset=offset, limit=limit)
    if len(items) < MIN_ITEMS:
        raise InvalidRequestError(
            f"calibration needs at least {MIN_ITEMS} items; {len(items)} were given",
            "give more prompts (or a larger --limit)",
        )
    for spec in grid:
        parse_fusion(spec)  # a bad setting fails before any model loads
    folder = Path(out)
    name = leader or _largest(members, member_options)
    systems = [MEMBER_PREFIX + name] + [FUSION_PREFIX + spec for spec in grid]
    path = run_eval(
        task,
        folder,
        systems=systems,
        members=members,
        offset=offset,
        limit=limit,
        max_tokens=max_tokens,
        data=data,
        progress=progress,
        member_options=member_options,
    )
    settings = compare(read_records(path), {i.id for i in items}, systems)
    chosen = choose(settings)
    options = {k: v for k, v in parse_fusion(chosen.spec).items() if k != "members"}
    run = json.loads((folder / f"{task.name}.run.json").read_text())
    profile = write_profile(
        folder / "profile.toml",
        options,
        {
            "task": task.name,
            "data": str(data) if data else None,
            "members": run["members"],
            "leader": name,
            "settings": run["settings"],
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "chosen": asdict(chosen),
            "grid": [asdict(s) for s in settings],
        },
    )
    return profile, settings, chosen


def _largest(members: Sequence[str] | None, member_options: dict[str, Any] | None) -> str:
    """The member the engine's gate would make leader: the one with the most parameters."""
    from ..ensemble import Ensemble

    with Ensemble(list(members) if members else None, **(member_options or {})) as ensemble:
        sizes = [m.n_params or 0 for m in ensemble.members]
        return ensemble.members[sizes.index(max(sizes))].name


def compare(records: Sequence[dict[str, Any]], ids: set[str], systems: Sequence[str]) -> list[Setting]:
    """Each grid setting against the leader (systems[0]) on the items both have answered."""
    by = {(r["system"], r["id"]): r for r in records if r["id"] in ids and "error" not in r}
    leader = systems[0]
    out = []
    for system in systems[1:]:
        common = sorted(i for i in ids if (leader, i) in by and (system, i) in by)
        if not common:
            continue
        mine = [bool(by[(system, i)]["correct"]) for i in common]
        theirs = [bool(by[(leader, i)]["correct"]) for i in common]
        ratio = fmean(by[(system, i)]["total_s"] for i in common) / max(
            1e-9, fmean(by[(leader, i)]["total_s"] for i in common)
        )
        out.append(
            Setting(
                system[len(FUSION_PREFIX) :],
                sum(mine),
                len(common),
                sum(a and not b for a, b in zip(mine, theirs)),
                sum(b and not a for a, b in zip(mine, theirs)),
                ratio,
                sum(theirs),
            )
        )
    return out


def choose(settings: Sequence[Setting]) -> Setting:
    """The cheapest setting right on more items than the leader alone; else the leader alone.

    A tie is not worth its time: the leader alone is then the cheapest setting that does not lose.
    """
    gaining = [s for s in settings if s.correct > s.leader_correct]
    if gaining:
        return min(gaining, key=lambda s: (s.time_ratio, s.only_leader))
    n = max((s.items for s in settings), default=0)
    leader_correct = max((s.leader_correct for s in settings), default=0)
    return Setting(LEADER_ALONE, leader_correct, n, 0, 0, 1.0, leader_correct)
