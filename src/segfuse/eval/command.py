"""The body of `segfuse eval` (kept here so the CLI module stays light)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError
from ..member_options import MemberOptions
from ..options import FusionOptions


def run_command(
    task: str | None,
    report: str | None,
    systems: str,
    limit: int | None,
    offset: int,
    model: list[str] | None,
    out: str,
    data: str | None,
    progress: bool,
    member_options: dict[str, Any],
    settings: dict[str, Any],
    options: dict[str, Any],
) -> None:
    """Run an evaluation (then write its report), or only rebuild a report.

    `settings` are the run's shared settings (max_tokens, temperature, top_p, seed,
    window, stop, hedge_persist); `options` are fusion options for every fusion system; `member_options`
    are MemberOptions fields, checked here before any model loads.
    """
    from .report import build_report

    if report is not None:
        if task is not None:
            raise InvalidRequestError("give a TASK or --report DIR, not both", "segfuse eval --report runs/eval")
        written = build_report(report)
        sys.stderr.write(f"report: {written}\n")
        sys.stdout.write(Path(written).read_text(encoding="utf-8"))
        return
    if task is None:
        raise InvalidRequestError("no task given", "segfuse eval gsm8k --limit 20   (or: --report DIR)")
    from .runner import run_eval

    FusionOptions.build(**options)  # a bad value fails before any model loads
    member_options = MemberOptions.build(member_options).given()
    temperature = settings.get("temperature", 0.0)
    path = run_eval(
        task,
        out,
        systems=systems,
        members=model,
        limit=limit,
        offset=offset,
        max_tokens=settings.get("max_tokens"),
        temperature=temperature,
        top_p=settings.get("top_p"),
        seed=settings.get("seed", 0),
        window=settings.get("window", 10),
        stop=tuple(settings.get("stop", ())),
        data=data,
        progress=progress,
        member_options=member_options,
        hedge_persist=settings.get("hedge_persist", False),
        options=options,
    )
    written = build_report(path.parent)
    sys.stderr.write(f"results: {path}\nreport: {written}\n")
    sys.stdout.write(Path(written).read_text(encoding="utf-8"))
