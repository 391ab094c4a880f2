"""`segfuse bench`: the benchmarks as subcommands, each with its own flags; `speed` (the side-by-side table) here.

Plain `segfuse bench` runs `speed` at its defaults. The flags that used to choose a benchmark
(`--serve`, `--serve --chat`, `--serve --soak 30m`, `--ray`, ...) are answered with the subcommand line that
does the same (:func:`new_spelling`). The serving benchmarks are in `bench_serving.py`, the GPU check in
`bench_gpu.py`.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ..errors import SegfuseError
from ..extras import require
from .app import Group, app, err
from .flags import ModelOpt

if TYPE_CHECKING:
    from ..bench.speed.plan import Plan

# The subcommands in the order `segfuse bench --help` lists them (their modules register them alphabetically).
ORDER = ("speed", "drafting", "serve", "users", "chat", "followers", "soak", "ray", "gpu")
# The old flags that chose a benchmark, each with the subcommand that is that benchmark now.
MODE_FLAGS = {"--chat": "chat", "--followers": "followers", "--ray": "ray", "--serve": "serve"}


def new_spelling(args: Sequence[str]) -> list[str]:
    """The words after `segfuse bench` that do what an old flag spelling did (`--serve --soak 10m --ray` ->
    `soak 10m --ray`); the other flags follow as given."""
    rest = [a for a in args if a not in MODE_FLAGS]
    soak = next((i for i, a in enumerate(rest) if a == "--soak" or a.startswith("--soak=")), None)
    if soak is not None:  # the soak keeps --ray: its own flag (the soak against `serve --ray`)
        word = rest[soak]
        if "=" in word:
            duration, kept = word.partition("=")[2], rest[:soak] + rest[soak + 1 :]
        else:
            duration = rest[soak + 1] if soak + 1 < len(rest) else "DURATION"
            kept = rest[:soak] + rest[soak + 2 :]
        return ["soak", duration, *(["--ray"] if "--ray" in args else []), *kept]
    mode = next((name for flag, name in MODE_FLAGS.items() if flag in args), "speed")
    return [mode, *rest]


class BenchGroup(Group):
    """`segfuse bench` followed by a flag is an old spelling: it is answered with the new one before click
    would say only "no such option"."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0].startswith("-") and args[0] not in ctx.help_option_names:
            raise SegfuseError(
                f"`segfuse bench {shlex.join(args)}`: each benchmark is a subcommand now",
                f"use `segfuse bench {shlex.join(new_spelling(args))}` (`segfuse bench --help` lists them)",
            )
        return super().parse_args(ctx, args)

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))


bench_app = typer.Typer(cls=BenchGroup, invoke_without_command=True)
app.add_typer(bench_app, name="bench")


@bench_app.callback()
def bench(ctx: typer.Context) -> None:
    """Benchmarks that print ratios measured side by side in one run (docs/performance.md).

    Without a subcommand, `segfuse bench` runs `segfuse bench speed` at its defaults (`make bench`).
    """
    if ctx.invoked_subcommand is None:
        speed()


# The speed benchmark's options, named once here so that the command's signature reads as a list.
Lengths = Annotated[str, typer.Option(help="Answer lengths in tokens, comma-separated.")]
Reps = Annotated[int, typer.Option(help="Repetitions per length (median and spread).")]
Window = Annotated[int, typer.Option(min=1, help="Max tokens each member drafts per round.")]
Out = Annotated[str, typer.Option(help="Folder for bench.json and the per-round plot.")]
Rss = Annotated[
    bool | None,
    typer.Option(
        "--rss/--no-rss",
        help="Measure peak RSS in subprocesses (default: unless a member is on a GPU, where it is meaningless).",
    ),
]
Reference = Annotated[
    bool | None,
    typer.Option(
        "--reference/--no-reference",
        help="Time the paper's reference method, every context re-encoded every round (default: when every member "
        "is a llama.cpp one; only they re-encode).",
    ),
]
ResponseLevel = Annotated[
    bool,
    typer.Option(
        "--response-level/--no-response-level",
        help="Time the response-level ensemble: every member writes the whole answer, every member scores it.",
    ),
]
Users = Annotated[
    int,
    typer.Option(
        "--users",
        min=0,
        help="N requests at once (generate_many) against the same N one by one, for the default and plain "
        "fusion (0: not measured).",
    ),
]


@bench_app.command()
def speed(
    model: ModelOpt = None,
    lengths: Lengths = "128,256",
    reps: Reps = 3,
    window: Window = 10,
    out: Out = "runs/bench",
    rss: Rss = None,
    reference: Reference = None,
    response_level: ResponseLevel = True,
    users: Users = 4,
) -> None:
    """Time plain fusion (gate none, accept-margin none: every member drafts and votes every round)
    against its members, the floor, the reference method and response level, and the default (the
    leader alone) against the leader by itself; both with N users at once against one by one. Members
    may be llama.cpp or transformers ones, on the CPU or a GPU; the systems and their options are
    printed first (docs/performance.md).
    """
    from ..bench.speed.plan import Plan

    plan = Plan(
        lengths=_lengths(lengths),
        reps=reps,
        window=window,
        users=users,
        rss=rss,
        reference=reference,
        response_level=response_level,
    )
    _bench_local(plan, model, out)


def _lengths(lengths: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in lengths.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise SegfuseError(f"--lengths {lengths!r} is not a list of token counts", "e.g. --lengths 128,256")
    return sizes


def _bench_local(plan: Plan, model: list[str] | None, out: str) -> None:
    require("bench", "segfuse bench speed")
    from ..bench.speed import local as benchmark
    from ..bench.speed.systems import describe_systems
    from ..bench.speed.table import tables

    report = benchmark.run(plan, model or None, Path(out), log=err.print)
    console = Console(width=240)
    for system, header, rows in tables(report):
        table = Table(*header, title=f"segfuse benchmark: {system} ({', '.join(report['models'])})")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print("; ".join(describe_systems(plan.window)))
    if report["skipped"]:
        console.print("left out: " + "; ".join(report["skipped"]))
    plot = f" and {report['plot']}" if "plot" in report else ""
    err.print(f"wrote {Path(out) / 'bench.json'}{plot}")
