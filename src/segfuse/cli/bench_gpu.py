"""`segfuse bench gpu`: the GPU check's table (`bench/gpu/check.py`) in this environment.

The check usually runs from its pack on a machine with nothing of segfuse installed (`make gpu-pack`, then
`python3 .cache/gpu-pack/check.py`, docs/deploy.md); this command runs the same phases with the segfuse and
torch installed here, reading the pack only for its tokenizers and its commit.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated

import typer

from ..bench.gpu.check import DEFAULTS, DTYPES
from ..errors import SegfuseError
from ..extras import require
from .bench import bench_app

Dtype = Annotated[str, typer.Option(help=f"The members' weights: {', '.join(DTYPES)}.")]


@bench_app.command()
def gpu(
    pack: Annotated[Path, typer.Option(help="The pack (`make gpu-pack`): its tokenizers and pack.json.")] = Path(
        ".cache/gpu-pack"
    ),
    out: Annotated[Path, typer.Option(help="The folder for gpu-check.json.")] = Path("runs/gpu-check"),
    budget: Annotated[float, typer.Option(help="Seconds after which phases are skipped.")] = DEFAULTS["budget"],
    small: Annotated[
        bool, typer.Option("--small", help="Every shape shrunk (2 layers, hidden 64): a dry run.")
    ] = False,
    device: Annotated[
        str | None, typer.Option(help="Where the members run (default: cuda:0 when torch sees a card, else cpu).")
    ] = None,
    dtype: Dtype = DEFAULTS["dtype"],
    tokens: Annotated[int, typer.Option(min=1, help="The answers' length.")] = DEFAULTS["tokens"],
    reps: Annotated[int, typer.Option(min=1, help="Repetitions of the table.")] = DEFAULTS["reps"],
    users: Annotated[int, typer.Option(min=0, help="Requests at once against one by one (0: not timed).")] = DEFAULTS[
        "users"
    ],
    window: Annotated[int, typer.Option(min=1, help="Max tokens each member drafts per round.")] = DEFAULTS["window"],
    diagnose_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens of the leader's bare decode, on each kind of thread.")
    ] = DEFAULTS["diagnose_tokens"],
) -> None:
    """Three members of real sizes with random weights (Qwen2.5-7B, SmolLM2-1.7B, Gemma-3-1B shapes) on one
    card: the leader's decode on each kind of thread, the drafting rows, then the speed table and its users rows
    (docs/deploy.md#checking-on-a-gpu). Exits 1 when a phase failed."""
    if dtype not in DTYPES:
        raise SegfuseError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}", "e.g. --dtype bf16")
    if not (pack / "tokenizers").is_dir():
        raise SegfuseError(f"{pack} is not a GPU check pack (no tokenizers/ in it)", "make it with `make gpu-pack`")
    require("hf", "segfuse bench gpu")
    from ..bench.gpu import check as gpu_check

    settings = {**DEFAULTS, "budget": budget, "small": small, "dtype": dtype, "tokens": tokens, "reps": reps}
    settings |= {"users": users, "window": window, "diagnose_tokens": diagnose_tokens}
    args = argparse.Namespace(pack=pack, out=out, device=device or gpu_check.default_device(), **settings)
    raise typer.Exit(gpu_check.run(args))
