"""`segfuse score`: how likely each member, and the pool, find given continuations of a context."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from .app import app, out
from .flags import ModelOpt, member_flags

if TYPE_CHECKING:
    from ..likelihood import ItemScores


@app.command()
@member_flags()
def score(
    context: Annotated[str, typer.Argument(help="The text before the choices, read as it is (no chat template).")],
    choices: Annotated[list[str], typer.Argument(help="The continuations to score (their order is kept).")],
    model: ModelOpt = None,
    rule: Annotated[
        str, typer.Option(help="Pooling: loglinear-byte, loglinear-whole, mixture-byte or mixture-whole.")
    ] = "loglinear-byte",
    weight: Annotated[
        list[str] | None,
        typer.Option(
            "--weight",
            help="NAME=W, a member's pooling weight (repeat; default uniform; `segfuse calibrate pooling` fits them).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object, for scripts.")] = False,
    member_options: dict[str, Any] | None = None,
) -> None:
    """Every member's summed log-probability of each choice after CONTEXT (with its tokens, bytes and
    whether it is the member's greedy continuation), and the pooled score; the pool's pick is marked.

    The context's trailing whitespace starts each choice, as lm-eval tokenizes.
    """
    from ..ensemble import Ensemble
    from ..likelihood import weight_pairs

    weights = weight_pairs(weight or [], "=", "--weight", "write NAME=WEIGHT")
    with Ensemble(model or None, **(member_options or {})) as ensemble:
        scored = ensemble.score(context, choices, rule=rule, weights=weights or None)
    if as_json:
        sys.stdout.write(json.dumps(as_dict(scored), indent=2) + "\n")
        return
    out.print(score_table(scored))


def as_dict(scored: ItemScores) -> dict[str, Any]:
    """The scores as JSON-ready data."""
    return {
        "context": scored.context,
        "rule": scored.rule.name,
        "weights": scored.rule.member_weights(list(scored.members)),
        "choices": [
            {
                "text": text,
                "fused": scored.fused[i],
                "best": i == scored.best,
                "members": {
                    name: {
                        "logprob": row[i].logprob,
                        "tokens": row[i].tokens,
                        "bytes": row[i].bytes,
                        "per_byte": row[i].per_byte,
                        "greedy": row[i].greedy,
                    }
                    for name, row in scored.members.items()
                },
            }
            for i, text in enumerate(scored.choices)
        ],
        "seconds": scored.seconds,
    }


def score_table(scored: ItemScores) -> Table:
    """One row per choice: each member's log-probability (per byte, tokens, greedy mark) and the pool."""
    names = list(scored.members)
    table = Table(
        "choice",
        *names,
        f"{scored.rule.name}",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        title="log-probability (per byte) \\[tokens], *: greedy",
        title_justify="left",
    )
    for column in table.columns[1:]:
        column.justify = "right"
    for i, text in enumerate(scored.choices):
        cells = []
        for name in names:
            s = scored.members[name][i]
            cells.append(f"{s.logprob:.2f} ({s.per_byte:.3f}) [{s.tokens}]{'*' if s.greedy else ''}")
        mark = " ←" if i == scored.best else ""
        table.add_row(repr(text), *cells, f"{scored.fused[i]:.3f}{mark}")
    return table
