"""The body of `specfuse eval` (kept here so the CLI module stays light)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError


def run_command(
    task: str | None,
    report: str | None,
    systems: str,
    limit: int | None,
    offset: int,
    max_tokens: int | None,
    temperature: float,
    seed: int,
    window: int,
    model: list[str] | None,
    out: str,
    data: str | None,
    progress: bool,
    cache_dir: str | None,
    threads: int | None,
    n_ctx: int,
    hedge_persist: bool = False,
    **_: Any,
) -> None:
    """Run an evaluation (then write its report), or only rebuild a report."""
    from .report import build_report

    if report is not None:
        if task is not None:
            raise InvalidRequestError("give a TASK or --report DIR, not both", "specfuse eval --report runs/eval")
        written = build_report(report)
        sys.stderr.write(f"report: {written}\n")
        sys.stdout.write(Path(written).read_text(encoding="utf-8"))
        return
    if task is None:
        raise InvalidRequestError("no task given", "specfuse eval gsm8k --limit 20   (or: --report DIR)")
    from .runner import run_eval

    member_options = {k: v for k, v in {"cache_dir": cache_dir, "threads": threads, "n_ctx": n_ctx}.items() if v}
    path = run_eval(
        task, out, systems=systems, members=model, limit=limit, offset=offset, max_tokens=max_tokens,
        temperature=temperature, seed=seed, window=window, data=data, progress=progress,
        member_options=member_options, hedge_persist=hedge_persist,
    )
    written = build_report(path.parent)
    sys.stderr.write(f"results: {path}\nreport: {written}\n")
    sys.stdout.write(Path(written).read_text(encoding="utf-8"))
