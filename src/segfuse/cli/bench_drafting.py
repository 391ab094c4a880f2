"""`segfuse bench drafting`: drafting for the leader (off / members / lookup / auto) side by side with
llama-cpp-python's prompt lookup decoding and transformers' assisted generation (`bench/speed/drafting.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..errors import SegfuseError
from ..extras import require
from .app import err
from .bench import bench_app

Tasks = Annotated[str, typer.Option(help="Tasks, comma-separated: chat, code, edit, json, gsm8k.")]
PerTask = Annotated[int, typer.Option(min=1, help="Prompts per task.")]
HfPerTask = Annotated[
    int | None,
    typer.Option(min=0, help="Prompts per task for the transformers rows (default: --per-task; 0: none)."),
]
MaxTokens = Annotated[int, typer.Option("--max-tokens", min=1, help="max_tokens of every answer (greedy).")]
Threads = Annotated[int, typer.Option(min=1, help="llama.cpp threads (segfuse members and llama-cpp-python).")]
Data = Annotated[
    Path | None,
    typer.Option(help="The shared data folder (gsm8k/test_first1000.jsonl in it; default ../shared/data)."),
]
Leader = Annotated[str, typer.Option(help="The llama.cpp leader (a catalogue name or GGUF).")]
Drafters = Annotated[str, typer.Option(help="The llama.cpp drafters, comma-separated.")]
HfLeader = Annotated[str, typer.Option(help="The transformers leader (its GGUF converted once).")]
HfDrafter = Annotated[str, typer.Option(help="The transformers drafter (assistant model).")]
DraftMax = Annotated[int, typer.Option(min=1, help="draft_max: the most tokens a draft proposes.")]
Out = Annotated[Path, typer.Option(help="The report (JSON).")]


@bench_app.command()
def drafting(
    tasks: Tasks = "chat,code,edit,json,gsm8k",
    per_task: PerTask = 8,
    hf_per_task: HfPerTask = None,
    max_tokens: MaxTokens = 96,
    threads: Threads = 2,
    data: Data = None,
    leader: Leader = "qwen2.5-coder-1.5b",
    drafters: Drafters = "qwen2.5-coder-0.5b,smollm2-135m",
    hf_leader: HfLeader = "qwen2.5-coder-0.5b",
    hf_drafter: HfDrafter = "smollm2-135m",
    draft_max: DraftMax = 16,
    out: Out = Path("runs/bench-drafting.json"),
) -> None:
    """Tokens/s of segfuse's drafting for the leader (draft off, members, lookup, auto) against the leader
    alone and the engines' own speculative decoding, paired per prompt; whether each answer equals the leader
    alone's, and where it parts."""
    require("bench", "segfuse bench drafting")
    from ..bench.speed.drafting import DraftingPlan, run
    from ..bench.speed.drafting_prompts import TASKS
    from ..bench.speed.drafting_table import HEADER, table_rows
    from ..eval.tasks import default_data_path

    chosen = tuple(t.strip() for t in tasks.split(",") if t.strip())
    if not chosen or set(chosen) - set(TASKS):
        raise SegfuseError(f"--tasks {tasks!r}", f"choose among {', '.join(TASKS)}")
    plan = DraftingPlan(
        tasks=chosen,
        per_task=per_task,
        hf_per_task=hf_per_task,
        max_tokens=max_tokens,
        threads=threads,
        data=data or default_data_path("gsm8k/test_first1000.jsonl").parents[1],
        leader=leader,
        drafters=tuple(d.strip() for d in drafters.split(",") if d.strip()),
        hf_leader=hf_leader,
        hf_drafter=hf_drafter,
        draft_max=draft_max,
    )
    report = run(plan, out, log=err.print)
    table = Table(*HEADER, title=f"segfuse drafting benchmark (max_tokens {max_tokens}, greedy)")
    for row in table_rows(report["summary"]):
        table.add_row(*row)
    console = Console(width=200, highlight=False)
    console.print(table)
    if "note" in report:
        console.print(report["note"])
    err.print(f"wrote {out}")
