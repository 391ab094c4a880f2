"""`segfuse bench users`: several users on one leader through `segfuse serve`, against llama.cpp's own batch
of as many sequences, with drafting off and auto (`bench/serve/users.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ..extras import require
from .app import err
from .bench import bench_app

Users = Annotated[int, typer.Option(min=2, help="Users at once (and llama.cpp's sequences in one batch).")]
Tokens = Annotated[int, typer.Option(min=1, help="Tokens of every answer (greedy, run to length).")]
Reps = Annotated[int, typer.Option(min=1, help="Repetitions (the drafting modes take turns).")]
Threads = Annotated[int | None, typer.Option(help="llama.cpp threads of the leader (default: the server's).")]
Out = Annotated[Path, typer.Option(help="The report (JSON).")]


@bench_app.command()
def users(
    users: Users = 4,
    tokens: Tokens = 64,
    reps: Reps = 2,
    threads: Threads = None,
    out: Out = Path("runs/bench-users.json"),
) -> None:
    """What `segfuse serve` gains from N users at once against what llama.cpp gains by itself from N sequences
    in one batch, and drafting (auto) against none at that load (docs/performance.md#serving-many-users)."""
    require("bench", "segfuse bench users")
    from ..bench.serve.users import UsersPlan, run

    report = run(UsersPlan(users=users, tokens=tokens, reps=reps, threads=threads), out, log=err.print)
    print_summary(report, users)
    err.print(f"wrote {out}")


def print_summary(report: dict[str, Any], users: int) -> None:
    summary, n = report["summary"], str(users)
    console = Console(width=160, highlight=False)
    table = Table("", "1 user tok/s", f"{n} users tok/s", "gain", title="tokens/s (medians)")
    native = report["native"]
    table.add_row(
        "llama.cpp by itself",
        f"{min(native['lone_tokens_per_s']):.1f}-{max(native['lone_tokens_per_s']):.1f}",
        f"{min(native['batch_tokens_per_s']):.1f}-{max(native['batch_tokens_per_s']):.1f}",
        f"{summary['native_gain']:.2f}x",
    )
    for mode, tok in summary["tokens_per_s"].items():
        gain = summary["server_gain"][mode]
        table.add_row(f"segfuse serve, draft {mode}", f"{tok['1']:.1f}", f"{tok[n]:.1f}", f"{gain:.2f}x")
    console.print(table)
    for check in summary["checks"].values():
        met = "not measured" if check["met"] is None else ("met" if check["met"] else "NOT met")
        value = "-" if check["measured"] is None else f"{check['measured']:.2f}"
        console.print(f"{check['what']}: {value} (target {check['target']}: {met})")
