"""`segfuse eval`: accuracy of the ensemble against its members and a response-level rerank."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..extras import require
from .app import app
from .flags import ModelOpt, fusion_flags, hedge_persist_option

# Fusion options that are settings of the whole run (every system shares them, a resumed run must match);
# the others the user gives apply to every fusion system of the run, over the presets' own switches.
RUN_SETTINGS = ("max_tokens", "temperature", "top_p", "seed", "window", "stop")
HedgePersistOpt = Annotated[
    bool, hedge_persist_option("Hedge presets start each item from the weights they ended the last with.")
]


@app.command("eval")
# top_p is decided with the temperature (runner.run_eval): 1.0 when greedy, the paper's 0.9 when sampling.
@fusion_flags(
    defaults={"temperature": 0.0, "seed": 0, "max_tokens": None, "top_p": None},
    shown={"max_tokens": "the task's", "top_p": "1.0 at temperature 0, else 0.9"},
    members=True,
)
def eval_command(
    task: Annotated[str | None, typer.Argument(help="gsm8k or ifeval.")] = None,
    report: Annotated[str | None, typer.Option("--report", help="Only rebuild the report of this folder.")] = None,
    systems: Annotated[
        str, typer.Option(help="Comma list: specfuse, rerank, members, member:NAME, default, fusion:KEY=VALUE/...")
    ] = "specfuse,rerank,members",
    limit: Annotated[int | None, typer.Option(help="Number of items.")] = None,
    offset: Annotated[int, typer.Option(help="First item (0-based line of the data file).")] = 0,
    model: ModelOpt = None,
    out: Annotated[str, typer.Option(help="Output folder (JSONL, report, plots).")] = "runs/eval",
    data: Annotated[str | None, typer.Option(help="Task data file (JSONL).")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
    hedge_persist: HedgePersistOpt = False,
    fusion: dict[str, Any] | None = None,
    member_options: dict[str, Any] | None = None,
) -> None:
    """Evaluate the ensemble against its members and a response-level rerank (see docs/results.md).

    --max-tokens defaults to the task's budget; --temperature to 0 (greedy), --seed to 0, --top-p to 1.0
    when greedy (0.9 when sampling).
    """
    require("eval", "segfuse eval")
    from ..eval.command import run_command  # the eval extra's imports stay out of other commands

    options = dict(fusion or {})
    settings = {k: options.pop(k) for k in RUN_SETTINGS if k in options}
    settings["hedge_persist"] = hedge_persist  # a setting of the run, not a fusion option
    run_command(
        task=task,
        report=report,
        systems=systems,
        limit=limit,
        offset=offset,
        model=model,
        out=out,
        data=data,
        progress=progress,
        member_options=member_options or {},
        settings=settings,
        options=options,
    )
