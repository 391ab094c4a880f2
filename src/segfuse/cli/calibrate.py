"""`segfuse calibrate`: the cheapest engine setting that does not lose to the leader, on your own prompts."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Column, Table

from ..extras import require
from .app import app, err, out
from .flags import ModelOpt, member_flags

if TYPE_CHECKING:
    from ..eval.calibrate import Setting


# The options, named once here so that the command's signature reads as a list.
Task = Annotated[
    str,
    typer.Argument(
        help="gsm8k, ifeval, or jsonl: your own prompts (--data FILE --checker C); "
        "pooling: weights for `segfuse score` from scored items (--data)."
    ),
]
Data = Annotated[
    str | None,
    typer.Option(
        help='JSONL file of the items (jsonl: one {"prompt", "answer"} '
        "per line; built-in tasks: their data by default)."
    ),
]
Checker = Annotated[
    str | None,
    typer.Option(help="jsonl: when an answer is right: number, contains, regex or python:MODULE:FUNCTION."),
]
Settings = Annotated[
    list[str] | None,
    typer.Option(
        "--setting",
        help="A setting to try, KEY=VALUE/... as FusionOptions fields (repeatable; "
        "default: the leader verifying at margins 1, 2, 3 and today's vote).",
    ),
]
Leader = Annotated[str | None, typer.Option(help="The member to compare with (default: the largest).")]
Limit = Annotated[int, typer.Option(help="Number of items (at least 10).")]
Offset = Annotated[int, typer.Option(help="First item (0-based line of the data file).")]
MaxTokens = Annotated[int | None, typer.Option("--max-tokens", help="Answer budget (default: per task).")]
OutDir = Annotated[str, typer.Option("--out", help="Folder for the records (resumable) and profile.toml.")]
Progress = Annotated[bool, typer.Option("--progress/--no-progress")]
PoolingRule = Annotated[str, typer.Option(help="pooling: the rule to fit weights for.")]


@app.command()
@member_flags()
def calibrate(
    task: Task,
    data: Data = None,
    checker: Checker = None,
    model: ModelOpt = None,
    setting: Settings = None,
    leader: Leader = None,
    limit: Limit = 40,
    offset: Offset = 0,
    max_tokens: MaxTokens = None,
    out_dir: OutDir = "runs/calibrate",
    progress: Progress = True,
    rule: PoolingRule = "loglinear-byte",
    member_options: dict[str, Any] | None = None,
) -> None:
    """Run the leader alone and a few settings on the same items, paired; write the profile to use.

    The profile holds the cheapest setting right on more items than the leader (else the leader
    alone: a tie is not worth its time); load it with `--profile` in generate, chat, serve and eval.
    """
    if task == "pooling":
        return calibrate_pooling(data, rule, out_dir)
    require("eval", "segfuse calibrate")
    from ..eval.calibrate import DEFAULT_GRID
    from ..eval.calibrate import calibrate as run_calibration
    from ..eval.tasks import get_task, jsonl_task

    chosen_task = jsonl_task(checker) if task == "jsonl" else get_task(task)
    profile, settings, chosen = run_calibration(
        chosen_task,
        out_dir,
        members=model,
        grid=setting or DEFAULT_GRID,
        data=data,
        offset=offset,
        limit=limit,
        max_tokens=max_tokens,
        member_options=member_options,
        progress=progress,
        leader=leader,
    )
    out.print(calibration_table(chosen_task.name, settings, chosen))
    err.print(f"profile: {profile} ({chosen.spec}); use it with --profile {profile}")


def calibration_table(task: str, settings: list[Setting], chosen: Setting) -> Table:
    """The settings side by side. A setting is folded onto more lines rather than cut: at 80 columns
    every grid entry would otherwise end in the same `gate=0.5/accep…`."""
    table = Table(
        Column("setting", overflow="fold", min_width=16),
        Column("right", no_wrap=True),
        Column("only it right", justify="right"),
        Column("only the leader right", justify="right"),
        Column("time ÷ leader", justify="right"),
        title=f"calibration on {task}: the leader was right on {settings[0].leader_correct if settings else 0}",
    )
    for s in settings:
        mark = " ← chosen" if s.spec == chosen.spec else ""
        table.add_row(
            s.spec + mark, f"{s.correct}/{s.items}", str(s.only_this), str(s.only_leader), f"{s.time_ratio:.2f}×"
        )
    return table


def calibrate_pooling(data: str | None, rule: str, out_dir: str) -> None:
    """Fit pooling weights on scored items (JSONL records with every member's scores of every choice and
    the right ones, as the likelihood study writes them: a file or a folder of them)."""
    from pathlib import Path

    from ..errors import InvalidRequestError
    from ..likelihood import Rule
    from ..likelihood_weights import evaluate, fit_weights, read_items

    if not data:
        raise InvalidRequestError(
            "pooling needs --data: a JSONL file or folder of scored items",
            "write them with python -m segfuse.eval.likelihood_study",
        )
    chosen = Rule.parse(rule)
    items = read_items(data)
    weights = fit_weights(chosen, items)
    fitted, uniform = evaluate(Rule(chosen.pool, chosen.norm, weights), items)[0], evaluate(chosen, items)[0]
    table = Table(
        "member",
        Column("weight", justify="right"),
        title=f"{chosen.name} on {len(items)} items: {fitted} right with these weights, {uniform} with uniform ones",
    )
    for name, w in weights.items():
        table.add_row(name, f"{w:.2f}")
    out.print(table)
    path = Path(out_dir) / "pooling.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"rule": chosen.name, "weights": weights, "items": len(items), "right": fitted, "right_uniform": uniform},
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    flags = " ".join(f"--weight {n}={w:g}" for n, w in weights.items())
    err.print(f"weights: {path}; use them with segfuse score --rule {chosen.name} {flags}")
