"""Answering from the terminal: generate, chat, demo."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .. import models as catalogue
from ..errors import SegfuseError
from ..options import FusionOptions
from ..types import DoneEvent, Event, Message, Result, SegmentEvent

if TYPE_CHECKING:
    from ..constraints import Constraint
    from ..ensemble import Ensemble
from .app import app, err, out
from .flags import CacheOpt, ModelOpt, ThreadsOpt, fusion_flags, hedge_persist_option

COLOURS = ("cyan", "magenta", "yellow", "green", "blue", "red", "bright_white")
DEMO_QUESTION = "In two or three sentences, why is the sky blue?"
SystemOpt = Annotated[str | None, typer.Option(help="System message.")]


def load_ensemble(model: list[str] | None, member_options: dict[str, Any] | None) -> Ensemble:
    from ..ensemble import Ensemble  # imports llama.cpp: keep `segfuse models` light

    with err.status("loading members…"):
        return Ensemble(model or None, **(member_options or {}))


def legend(names: list[str]) -> str:
    return "  ".join(f"[{COLOURS[i % len(COLOURS)]}]■ {n}[/]" for i, n in enumerate(names))


def print_stream(events: Iterator[Event], names: list[str]) -> Result:
    """Print each segment in its author's colour as it comes; return the result."""
    colour = {n: COLOURS[i % len(COLOURS)] for i, n in enumerate(names)}
    for event in events:
        if isinstance(event, SegmentEvent):
            out.print(event.segment.text, style=colour[event.segment.model], end="", markup=False)
            out.file.flush()
        elif isinstance(event, DoneEvent):
            out.print()
            return event.result
    raise RuntimeError("stream ended without a result")


def summary_line(result: Result) -> str:
    s = result.stats
    wins = ", ".join(f"{n} {w}" for n, w in s.wins.items())
    ttfs = f"{s.time_to_first_segment_s:.2f} s" if s.time_to_first_segment_s is not None else "–"
    line = (
        f"{s.rounds} rounds · {s.tokens} tokens · {s.tokens_per_s:.1f} tok/s · first segment {ttfs} · "
        f"total {s.total_s:.1f} s · {s.model_calls} member calls ({s.calls_per_round:.1f}/round) · "
        f"wins: {wins} · finish: {s.finish_reason}"
    )
    # Voting weights of the last round in which two or more members still voted.
    voted = [r for r in result.rounds if len(r.weights) > 1]
    if voted and len(set(voted[-1].weights.values())) > 1:
        last = voted[-1]
        line += f" · weights (round {last.index}): " + ", ".join(f"{n} {w:.2f}" for n, w in last.weights.items())
    leaders = [r.leader for r in result.rounds if r.leader]
    if leaders:
        line += f" · {s.gated_rounds}/{s.rounds} rounds won alone by leader {leaders[0]}"
    verdicts = [v for r in result.rounds for v in r.consulted.values()]
    if verdicts:
        accepted = sum(v.startswith("accepted") for v in verdicts)
        line += f" · the leader accepted {accepted} of {len(verdicts)} proposals"
    penalised = sum(len(r.penalised) for r in result.rounds)
    if penalised:
        line += f" · {penalised} looping candidates held back"
    for d in result.departures:
        line += f" · {d.model} {'exited' if d.kind == 'exit' else 'failed'} in round {d.round}: {d.reason}"
    return line


def piped() -> str:
    """Standard input when something is piped in ("" for a terminal or an empty pipe)."""
    if sys.stdin is None or sys.stdin.closed or sys.stdin.isatty():
        return ""
    return sys.stdin.read().strip()


def read_prompt(prompt: str | None) -> str:
    """The user's message: the argument, piped text, or both (the piped document first, as `llm` does).

    ``-`` as the argument asks for standard input explicitly.
    """
    explicit = prompt == "-"
    text = piped()
    if explicit:
        prompt = None
        if not text:
            raise SegfuseError(
                "`-` reads the prompt from standard input, which is empty",
                "pipe a text in: echo 'What is 2+2?' | segfuse generate -",
            )
    parts = [p for p in (text, (prompt or "").strip()) if p]
    if not parts and prompt is not None:
        raise SegfuseError("the prompt is empty", "write a question, or pipe a text in")
    if not parts:
        raise SegfuseError(
            "no prompt given", "pass it as an argument or pipe it in: echo 'What is 2+2?' | segfuse generate"
        )
    return "\n\n".join(parts)


def fusion_options(fusion: dict[str, Any]) -> FusionOptions:
    """The options the user gave, validated (unknown values get one clear line)."""
    return FusionOptions.build(**fusion)


@app.command()
@fusion_flags(members=True)
def generate(
    prompt: Annotated[
        str | None,
        typer.Argument(help="The question; piped standard input is read too (document first), `-` reads only it."),
    ] = None,
    model: ModelOpt = None,
    system: SystemOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole result as one JSON object.")] = False,
    json_schema: Annotated[
        str | None,
        typer.Option(
            "--json-schema", metavar="FILE", help="The answer is JSON that validates against the JSON schema in FILE."
        ),
    ] = None,
    json_object: Annotated[bool, typer.Option("--json-object", help="The answer is a JSON object.")] = False,
    fusion: dict[str, Any] | None = None,
    member_options: dict[str, Any] | None = None,
) -> None:
    """Answer PROMPT with the ensemble, streaming segments coloured by author."""
    options = fusion_options(fusion or {})
    constraint = read_constraint(json_schema, json_object)
    messages = ([Message("system", system)] if system else []) + [Message("user", read_prompt(prompt))]
    from ..request import FusionRequest

    request = FusionRequest.of(messages, options, constraint=constraint)  # checked before any model loads
    with load_ensemble(model, member_options) as ensemble:
        if as_json:
            result = ensemble.generate(request)
            sys.stdout.write(json.dumps(result.to_dict(), ensure_ascii=False) + "\n")
            return
        err.print(legend(ensemble.names))
        result = print_stream(ensemble.stream(request), ensemble.names)
        err.print(f"[dim]{summary_line(result)}[/]", soft_wrap=True)
        if result.invalid_reason:
            err.print(f"[bold red]the answer does not satisfy the schema:[/] {result.invalid_reason}")


def read_constraint(json_schema: str | None, json_object: bool) -> Constraint | None:
    """--json-schema FILE / --json-object -> the answer's constraint, checked before any model loads."""
    from pathlib import Path

    from ..constraints import Constraint

    if json_schema and json_object:
        raise SegfuseError("--json-schema and --json-object both given", "give one of them")
    if json_object:
        return Constraint.json_object()
    if not json_schema:
        return None
    try:
        schema = json.loads(Path(json_schema).read_text(encoding="utf-8"))
    except OSError as exc:
        raise SegfuseError(
            f"cannot read --json-schema {json_schema}: {exc.strerror}", "give a JSON schema file"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SegfuseError(f"--json-schema {json_schema} is not JSON: {exc}", "give a JSON schema file") from None
    return Constraint.json_schema(schema, where=f"--json-schema {json_schema}")


@app.command()
@fusion_flags(members=True)
def chat(
    model: ModelOpt = None,
    system: SystemOpt = None,
    hedge_persist: Annotated[
        bool, hedge_persist_option("With --hedge: each turn starts from the weights the last one ended with.")
    ] = False,
    fusion: dict[str, Any] | None = None,
    member_options: dict[str, Any] | None = None,
) -> None:
    """Multi-turn chat with the ensemble in the terminal (empty line or Ctrl-D ends).

    With text piped in, the whole text is one message: it is answered and the chat ends.
    """
    options = fusion_options(fusion or {})
    history: list[Message] = [Message("system", system)] if system else []
    text: str | None = piped()
    with load_ensemble(model, member_options) as ensemble:
        ensemble.hedge_persist = hedge_persist
        err.print(legend(ensemble.names))
        while True:
            if text:
                line, text = text, None  # the piped text is one turn, then the chat ends
            elif text is None:
                break
            else:
                try:
                    line = input("you> ").strip()
                except EOFError:
                    break
            if not line:
                break
            history.append(Message("user", line))
            try:
                result = print_stream(ensemble.stream(history, options=options), ensemble.names)
            except SegfuseError as exc:
                history.pop()
                err.print(f"[bold red]error:[/] {exc}")
                continue
            history.append(Message("assistant", result.text))
            err.print(f"[dim]{summary_line(result)}[/]", soft_wrap=True)


@app.command()
def demo(
    cache_dir: CacheOpt = None,
    threads: ThreadsOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Answer budget in tokens.")] = 96,
    seed: Annotated[int | None, typer.Option(help="Seed: same seed, same answer.")] = 0,
) -> None:
    """Prepare the embedded models and let them answer a built-in question together."""
    from .models import prepare_models

    prepare_models(list(catalogue.DEFAULT_MODELS), cache_dir)
    err.print(f"[bold]question:[/] {DEMO_QUESTION}")
    with load_ensemble(None, {"cache_dir": cache_dir, "threads": threads}) as ensemble:
        err.print(legend(ensemble.names))
        options = FusionOptions.build(max_tokens=max_tokens, seed=seed)
        result = print_stream(ensemble.stream(DEMO_QUESTION, options=options), ensemble.names)
        err.print(f"[dim]{summary_line(result)}[/]", soft_wrap=True)
    # The default lets the largest member answer alone (docs/results.md): say how to see the others at work.
    err.print(
        "[dim]by default the largest member leads and accepts none of the others' segments; "
        "`segfuse generate --accept-margin 2` lets it accept them, `--no-gate` is plain fusion[/]",
        soft_wrap=True,
    )
